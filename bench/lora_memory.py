#!/usr/bin/env python3
"""Host memory and NVMe traffic of LoRA against full fine-tuning, with aidaptiv and with stock DeepSpeed (issue 9).

Conditions: a model preset (default `tiny`, 58M parameters), fp32, one CPU process per run, each run in its own
process, a few steps (the first is warm-up, left out of the byte counts). Five sides:

- `full-aidaptiv`: full fine-tuning, ds_configs/aidaptiv.json (parameters and optimizer state streamed from NVMe)
- `lora-aidaptiv`: `--lora`, ds_configs/aidaptiv.json (the base streamed read-only, adapters trained)
- `lora-zero3`: `--lora` (PEFT), stock ZeRO-3 with everything in memory, ds_configs/zero3.json
- `lora-infinity`: `--lora` (PEFT), stock ZeRO-Infinity (parameters and optimizer on NVMe), ds_configs/zero_infinity.json
  (on either ZeRO-Infinity side, its parameter buffers sized to the largest parameter where the shipped 20M
  elements are smaller, as DeepSpeed documents)
- `full-infinity`: full fine-tuning, ds_configs/zero_infinity.json

Both aidaptiv sides get the same host budget (``--host-budget``). Every figure comes from the run's own metrics
file: peak RSS (the process's high-water mark, pinned pool included), NVMe bytes read and written per timed step
(the process's /proc/self/io, so every backend is counted the same way), trainable parameters, final loss.

    python bench/lora_memory.py [--model tiny] [--seq-len 128] [--steps 4] [--host-budget 256MiB]

Writes one JSON row per run to OUT/rows.jsonl and the table (with the machine it ran on) to OUT/summary.md.
"""

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from train_run import bench_setup, run_train  # noqa: E402  (bench/train_run.py)

from aidaptiv_ds.harness.machine import summary  # noqa: E402

# name -> (shipped config, LoRA or full fine-tuning, what the side is)
SIDES = {
    "full-aidaptiv": ("aidaptiv.json", False, "full fine-tuning, aidaptiv (weights and optimizer state on NVMe)"),
    "lora-aidaptiv": ("aidaptiv.json", True, "LoRA, aidaptiv (base streamed read-only from NVMe)"),
    "lora-zero3": ("zero3.json", True, "LoRA (PEFT), stock ZeRO-3, all in memory"),
    "lora-infinity": ("zero_infinity.json", True, "LoRA (PEFT), stock ZeRO-Infinity (params + optimizer on NVMe)"),
    "full-infinity": ("zero_infinity.json", False, "full fine-tuning, stock ZeRO-Infinity"),
}


def run_one(side, args, swap_root, env):
    config_name, lora, _ = SIDES[side]
    swap = tempfile.mkdtemp(prefix=f"{side}-", dir=swap_root)
    with open(os.path.join(ROOT, "ds_configs", config_name)) as f:
        cfg = json.load(f)
    cfg["optimizer"]["params"]["lr"] = args.lr
    if config_name == "zero_infinity.json":  # its buffers sized to the model's largest parameter, as documented
        from aidaptiv_ds.harness.eqmem import documented_config

        cfg = documented_config(cfg, args.model)
    config = os.path.join(swap, "config.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    metrics = os.path.join(swap, "metrics.json")
    cmd = [
        sys.executable,
        "-m",
        "aidaptiv_ds",
        "train",
        "--config",
        config,
        "--model",
        args.model,
        "--dtype",
        "fp32",
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--warmup",
        "1",
        "--nvme-path",
        swap,
        "--metrics-out",
        metrics,
        "--no-progress",
    ]
    if "aidaptiv" in cfg:
        cmd += ["--host-budget", args.host_budget]
    if lora:
        cmd += ["--lora", args.lora]
    return run_train(cmd, ROOT, env, swap, metrics, side=side, config=config_name, lora=args.lora if lora else None)


def cells(row):
    """The table's cells of one row: status, peak RSS MiB, NVMe MB read / written per timed step, trainable
    parameters, final loss, median step seconds."""
    m = row.get("metrics") or {}
    steps = m.get("nvme_bytes_steps")
    per = lambda k: "-" if m.get(k) is None or not steps else f"{m[k] / steps / 1e6:.2f}"
    trainable = (m.get("lora") or {}).get("trainable_params", m.get("params"))
    losses = m.get("losses") or []
    return [
        m.get("status", " ".join(row.get("error") or ["no metrics"])),
        "-" if m.get("peak_rss_mb") is None else f"{m['peak_rss_mb']:.0f}",
        per("nvme_read_bytes"),
        per("nvme_write_bytes"),
        "-" if trainable is None else f"{trainable:,}",
        f"{losses[-1]:.4f}" if losses else "-",
        "-" if m.get("step_s_median") is None else f"{m['step_s_median']:.2f}",
    ]


HEADER = (
    "| side | status | peak RSS MiB | NVMe read MB/step | NVMe write MB/step | trainable params | final loss "
    "| step s (noisy) |\n|---|---|---|---|---|---|---|---|"
)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (128)")
    p.add_argument("--steps", type=int, default=4, help="steps per run, the first is warm-up (4)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of every side (1e-3)")
    p.add_argument("--lora", default="r=16,alpha=32,targets=q_proj,v_proj", help="the --lora of the LoRA sides")
    p.add_argument("--host-budget", default="256MiB", help="host budget of both aidaptiv sides (256MiB)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated ({','.join(SIDES)})")
    p.add_argument("--swap-root", default=os.path.join(ROOT, "swap"), help="where swap folders are made")
    p.add_argument(
        "--out",
        help="folder for rows.jsonl and summary.md (default bench/results/lora_memory/<model>)",
    )
    args = p.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "lora_memory", args.model)
    unknown = [s for s in args.sides.split(",") if s not in SIDES]
    if unknown:
        p.error(f"--sides names {', '.join(unknown)}: expected some of {', '.join(SIDES)}")
    env, machine, sha, dirty = bench_setup(ROOT, args.swap_root, args.out)
    conditions = (
        f"`{args.model}` preset, fp32, micro-batch from the config (2), seq {args.seq_len}, {args.steps} "
        f"steps (first one warm-up), one CPU process, lr {args.lr}, LoRA `{args.lora}`, aidaptiv host "
        f"budget {args.host_budget}"
    )
    command = " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]])
    lines = [f"Command: `{command}`", f"Machine: {summary(machine)}", f"Conditions: {conditions}", "", HEADER]
    print("\n".join(lines), flush=True)
    with open(os.path.join(args.out, "rows.jsonl"), "a") as out:
        for side in args.sides.split(","):
            row = run_one(side, args, args.swap_root, env)
            row.update(
                git_sha=sha,
                git_dirty=dirty,
                time=time.strftime("%Y-%m-%dT%H:%M:%S"),
                machine=machine,
                model=args.model,
                seq_len=args.seq_len,
                steps=args.steps,
                lr=args.lr,
                host_budget=args.host_budget if "aidaptiv" in SIDES[side][0] else None,
            )
            out.write(json.dumps(row) + "\n")
            out.flush()
            line = f"| {side} | " + " | ".join(cells(row)) + " |"
            lines.append(line)
            print(line, flush=True)
    lines += ["", "Sides: " + "; ".join(f"`{k}`: {SIDES[k][2]}" for k in args.sides.split(",")) + "."]
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
