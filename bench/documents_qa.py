"""Documents to a model that knows them: fine-tune a real instruct model on questions and answers about a small
fictional document set (facts no model can know), and measure, before and after, how it answers questions about
it that are phrased differently from the training ones.

    python bench/documents_qa.py --model .cache/real-model/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out bench/results/documents_qa/smollm2-135m

Data (bench/documents_qa/): three short documents about the invented islands of Veltrane and a company there
(documents/*.md), and facts.json: for each of 16 facts, the answer, the sentence stating it, two phrasings of the
question to train on, and a third phrasing kept out of training to ask. The training records are chat messages
(question -> the fact's sentence), rendered through the model's chat template by `aidaptiv-ds train`; the
script writes them into its work folder, and the same files are committed as documents_qa/train.jsonl and
held_out.jsonl for trying by hand (docs/USAGE.md).

For each mode (LoRA on every linear layer, full fine-tuning), after the same number of epochs through
`aidaptiv-ds train` with the aidaptiv block (--dtype auto: the model's own precision where the CPU computes it
natively), the trained model (its --output-dir export) and the base are asked the held-out phrasings:
- exact match: the reply (greedy, through `aidaptiv_ds.inference.Generator` with the chat template) contains the
  fact's answer, case-insensitive;
- answer loss: the mean negative log-likelihood of the fact's sentence tokens after the held-out question's chat
  prompt (transformers, in memory), the loss on the answers only.
One JSON row per mode in OUT/rows.jsonl with every reply; OUT/summary.md is made from the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(HERE, "documents_qa")
MODES = {
    "lora": {
        "lora": "r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "lr": 2e-3,
    },
    "full": {"lora": None, "lr": 1e-4},
}


def facts() -> list:
    with open(os.path.join(DATA, "facts.json"), encoding="utf-8") as f:
        return json.load(f)


def write_records(folder: str) -> tuple[str, str]:
    """train.jsonl (two phrasings a fact) and held_out.jsonl (the third) as chat records."""
    train, held = os.path.join(folder, "train.jsonl"), os.path.join(folder, "held_out.jsonl")
    with open(train, "w", encoding="utf-8") as t, open(held, "w", encoding="utf-8") as h:
        for fact in facts():
            for q in fact["train"]:
                msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": fact["sentence"]}]
                t.write(json.dumps({"messages": msgs}) + "\n")
            msgs = [{"role": "user", "content": fact["ask"]}, {"role": "assistant", "content": fact["sentence"]}]
            h.write(json.dumps({"messages": msgs}) + "\n")
    return train, held


def answer_loss(folder: str) -> float:
    """Mean NLL of the facts' sentence tokens after the held-out questions' chat prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for fact in facts():
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": fact["ask"]}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(fact["sentence"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p_ids + a_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p_ids) - 1 : -1].float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(a_ids), reduction="sum")
        total, count = total + nll.item(), count + len(a_ids)
    return total / count


def ask(folder: str) -> list:
    """Each held-out question's greedy reply and whether it contains the answer."""
    from aidaptiv_ds.inference import Generator

    out = []
    with Generator(folder, device="cpu") as gen:
        questions = [[{"role": "user", "content": f["ask"]}] for f in facts()]
        for fact, r in zip(facts(), gen.generate(questions, max_new_tokens=32, batch_size=16)):
            out.append(
                {
                    "question": fact["ask"],
                    "answer": fact["answer"],
                    "reply": r.text,
                    "exact": fact["answer"].lower() in r.text.lower(),
                }
            )
    return out


def evaluate(folder: str) -> dict:
    replies = ask(folder)
    return {
        "exact_match": sum(r["exact"] for r in replies),
        "questions": len(replies),
        "answer_loss": round(answer_loss(folder), 4),
        "replies": replies,
    }


def train(model: str, mode: str, folder: str, args) -> dict:
    """One fine-tune through `aidaptiv-ds train`, its model exported into ``folder`` (a work folder: the
    exports are not results to commit)."""
    os.makedirs(folder, exist_ok=True)
    train_file, held_file = write_records(folder)
    out = os.path.join(folder, f"model_{mode}")
    metrics = os.path.join(folder, f"train_{mode}.json")
    setting = MODES[mode]
    cmd = [
        sys.executable,
        "-m",
        "aidaptiv_ds",
        "train",
        "--config",
        os.path.join(ROOT, "ds_configs", "aidaptiv.json"),
        "--model",
        model,
        "--data",
        train_file,
        "--eval-data",
        held_file,
        "--epochs",
        str(args.epochs),
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--lr",
        str(setting["lr"]),
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "4",
        "--dtype",
        args.dtype,
        "--seed",
        str(args.seed),
        "--nvme-path",
        folder,
        "--output-dir",
        out,
        "--metrics-out",
        metrics,
        "--no-progress",
    ]
    if setting["lora"]:
        cmd += ["--lora", setting["lora"]]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{mode}: aidaptiv-ds train failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    with open(metrics, encoding="utf-8") as f:
        m = json.load(f)
    return {
        "command": " ".join(cmd[1:]),
        "out": out,
        "wall_s": round(wall, 1),
        "steps": m["steps"],
        "losses": m["losses"],
        "eval_losses": m.get("eval_losses"),
        "dtype": m.get("dtype"),
        "precision_reason": m.get("precision_reason"),
        "tokens_per_s": m.get("tokens_per_s"),
        "lora": m.get("lora"),
    }


def summary(rows: list) -> str:
    base = rows[0]["base"]
    lines = [
        "# Documents to a model that knows them",
        "",
        f"Model: {rows[0]['model']}; machine: {rows[0]['machine']}; git {rows[0]['git_sha']}.",
        f"Command: `python bench/documents_qa.py {rows[0]['args']}` (rows in rows.jsonl, every reply in them).",
        "",
        "16 facts about an invented archipelago; trained on two phrasings of each question, asked a third.",
        "",
        "| model | exact match (of 16) | answer loss | epochs | steps | train wall | precision |",
        "|---|---|---|---|---|---|---|",
        f"| base | {base['exact_match']} | {base['answer_loss']:.3f} | | | | |",
    ]
    for r in rows:
        a = r["after"]
        lines.append(
            f"| {r['mode']} ({r['train']['lora']['spec'] if r['train'].get('lora') else 'all weights'}) | "
            f"{a['exact_match']} | {a['answer_loss']:.3f} | {r['epochs']} | {r['train']['steps']} | "
            f"{r['train']['wall_s']:.0f} s | {r['train']['dtype']} |"
        )
    lines += ["", "Replies to the held-out questions (base, then each mode):", ""]
    for i, b in enumerate(base["replies"]):
        lines.append(f"- {b['question']} (answer: {b['answer']})")
        lines.append(f"  - base: {b['reply']!r}")
        for r in rows:
            x = r["after"]["replies"][i]
            lines.append(f"  - {r['mode']}: {x['reply']!r}{' ✓' if x['exact'] else ''}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the instruct model: a folder, a hub id or a .gguf file")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "documents_qa", "smollm2-135m"))
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench_work", "documents_qa"), help="swap and exports")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--epochs", type=float, default=12)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from aidaptiv_ds.harness.machine import cpu_line, machine_info
    from aidaptiv_ds.harness.results import git_state
    from aidaptiv_ds.models.locate import model_folder

    os.makedirs(args.out, exist_ok=True)
    base_folder = model_folder(args.model, log=lambda m: print(m, file=sys.stderr))
    machine = machine_info(args.out)
    info = {
        "model": args.model,
        "machine": f"{cpu_line(machine)}, {machine.get('threads')} threads, {machine.get('ram_gb')} GiB",
        "git_sha": git_state()[0],
        "args": " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print("asking the base model", file=sys.stderr)
    base = evaluate(base_folder)
    rows = []
    for mode in args.modes.split(","):
        print(f"training: {mode}", file=sys.stderr)
        trained = train(args.model, mode, os.path.join(args.work, mode), args)
        print(f"asking the {mode} model", file=sys.stderr)
        after = evaluate(trained["out"])
        row = {
            **info,
            "mode": mode,
            "epochs": args.epochs,
            "base": base,
            "after": after,
            "train": trained,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        rows.append(row)
        with open(os.path.join(args.out, "rows.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{mode}: exact {base['exact_match']} -> {after['exact_match']} of 16, answer loss "
            f"{base['answer_loss']:.3f} -> {after['answer_loss']:.3f}",
            file=sys.stderr,
        )
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
