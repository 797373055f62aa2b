"""GGUF files written by `aidaptiv-ds export --format gguf`, run by llama.cpp itself (llama-cpp-python, built from
the package index into its own virtual environment, its build time recorded): the reply to a chat question and
the prompt's token ids, beside what transformers gives for the Hugging Face folder the file was written from.

    python bench/gguf_llamacpp.py --model MODEL_DIR --out bench/results/gguf_llamacpp/smollm2-135m \\
        [--llamacpp-venv .bench_work/llamacpp-venv]

The suite checks the files with transformers' GGUF reader (tests/real/test_gguf_export.py); llama.cpp takes half an
hour and more to build on two cores, so it is checked here. One row per GGUF type in OUT/rows.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
QUESTION = "What is the capital of France?"
TEXT = "What is 12345?"
PROBE = r"""
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, verbose=False, seed=0)
r = llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[2]}], max_tokens=32, temperature=0)
print(json.dumps({"reply": r["choices"][0]["message"]["content"], "ids": llm.tokenize(sys.argv[3].encode(), add_bos=False)}))
"""


def llamacpp_python(venv: str) -> tuple[str, float | None]:
    """The venv's python with llama-cpp-python, built now if missing (and how long that took, else None)."""
    python = os.path.join(venv, "bin", "python")
    if (
        os.path.exists(python)
        and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    ):
        return python, None
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    t0 = time.perf_counter()
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=OFF")  # a build that runs on other CPUs of this kind too
    subprocess.run([python, "-m", "pip", "install", "-q", "llama-cpp-python"], check=True, env=env)
    return python, time.perf_counter() - t0


def transformers_side(folder: str, question: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    return {"reply": reply, "ids": tok(TEXT, add_special_tokens=False)["input_ids"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder (an export, or a converted model)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gguf_llamacpp", "smollm2-135m"))
    ap.add_argument("--llamacpp-venv", default=os.path.join(ROOT, ".bench_work", "llamacpp-venv"))
    ap.add_argument("--types", default="bf16,q8_0")
    ap.add_argument("--question", default=QUESTION, help="the chat question both sides answer")
    ap.add_argument("--build-s", type=float, default=None, help="the build time of an existing venv, when known")
    ap.add_argument("--build-note", default="", help="what else the machine did during that build, if anything")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from aidaptiv_ds.harness.machine import cpu_line, machine_info
    from aidaptiv_ds.harness.results import git_state
    from aidaptiv_ds.models.gguf_writer import write

    os.makedirs(args.out, exist_ok=True)
    python, built = llamacpp_python(args.llamacpp_venv)
    version = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
    want = transformers_side(args.model, args.question)
    work = os.path.join(ROOT, ".bench_work", "gguf_llamacpp")
    os.makedirs(work, exist_ok=True)
    machine = machine_info(work)
    rows = []
    for kind in args.types.split(","):
        path = os.path.join(work, f"model-{kind}.gguf")
        if os.path.exists(path):
            os.unlink(path)
        t0 = time.perf_counter()
        summary = write(args.model, path, kind)
        written_s = time.perf_counter() - t0
        p = subprocess.run(
            [python, "-c", PROBE, path, args.question, TEXT], capture_output=True, text=True, timeout=600
        )
        if p.returncode != 0:
            raise SystemExit(f"llama.cpp could not run {path}:\n{p.stderr[-3000:]}")
        got = json.loads(p.stdout.strip().splitlines()[-1])
        row = {
            "type": kind, "bytes": summary["bytes"], "write_s": round(written_s, 1),
            "llamacpp_reply": got["reply"], "transformers_reply": want["reply"],
            "same_reply": got["reply"].strip() == want["reply"].strip(), "same_ids": got["ids"] == want["ids"],
            "llama_cpp_python": version, "build_s": round(built, 0) if built else args.build_s, "build_note": args.build_note,
            "model": args.model, "question": args.question, "machine": f"{cpu_line(machine)}, {machine.get('threads')} threads",
            "git_sha": git_state()[0], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }  # fmt: skip
        rows.append(row)
        with open(os.path.join(args.out, "rows.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{kind}: llama.cpp {got['reply']!r} (transformers {want['reply']!r}), ids equal: {row['same_ids']}")
    lines = [
        "# GGUF exports run by llama.cpp",
        "",
        f"Model: {args.model}; llama-cpp-python {version}"
        + (f", built from the package index in {rows[0]['build_s']:.0f} s" if rows[0]["build_s"] else "")
        + (f" ({rows[0]['build_note']})" if rows[0]["build_note"] else "")
        + f"; machine: {rows[0]['machine']}; git {rows[0]['git_sha']}.",
        f"Command: `python bench/gguf_llamacpp.py {shlex.join(argv if argv is not None else sys.argv[1:])}`.",
        f"Question (through the chat template, greedy): {args.question!r}.",
        "",
        "| type | file | llama.cpp's reply | transformers' reply (the folder) | same reply | same prompt ids |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['type']} | {r['bytes'] / 2**20:.0f} MiB | {r['llamacpp_reply']!r} | {r['transformers_reply']!r} | "
            f"{'yes' if r['same_reply'] else 'no'} | {'yes' if r['same_ids'] else 'no'} |"
        )
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
