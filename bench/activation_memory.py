#!/usr/bin/env python3
"""Peak host memory of one long-sequence training step with each activation policy (issue 13).

Conditions: a model preset (default `tiny`, 58M parameters), fp32, micro-batch 1, one CPU process, a few
steps at each sequence length. Runs `aidaptiv-ds train` with ds_configs/aidaptiv.json and its
`"activations"` object set to each policy (`keep` with the model's own unchunked loss, `keep` with the
chunked loss, `recompute`, `nvme`), and in-memory ZeRO-3 (ds_configs/zero3.json) as the reference. Every
figure comes from the runs' own metrics files: peak RSS (which includes the pinned pool), step time and its
split, the activation counters. A run that fails (out of memory included) is a row with its status.

    python bench/activation_memory.py [--seq-lens 1024,2048] [--steps 2] [--out bench/results/activation_memory/tiny]

Writes one JSON row per run to OUT/rows.jsonl and prints a table.
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

# name -> (shipped config, "activations" object or None for a config without an aidaptiv block)
VARIANTS = {
    "zero3": ("zero3.json", None),
    "keep-unchunked": ("aidaptiv.json", {"policy": "keep", "loss_chunk_tokens": 0}),
    "keep": ("aidaptiv.json", {"policy": "keep"}),
    "recompute": ("aidaptiv.json", {"policy": "recompute"}),
    "nvme": ("aidaptiv.json", {"policy": "nvme"}),
}


def run_one(variant, seq_len, args, swap_root, env):
    config_name, activations = VARIANTS[variant]
    swap = tempfile.mkdtemp(prefix=f"{variant}-", dir=swap_root)
    with open(os.path.join(ROOT, "ds_configs", config_name)) as f:
        cfg = json.load(f)
    if activations is not None:
        cfg["aidaptiv"]["activations"] = activations
        cfg["aidaptiv"]["host_memory_budget"] = args.host_budget
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
        "--seq-len",
        str(seq_len),
        "--micro-batch",
        "1",
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
    return run_train(cmd, ROOT, env, swap, metrics, variant=variant, activations=activations, seq_len=seq_len)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument("--seq-lens", default="1024,2048", help="comma-separated sequence lengths (1024,2048)")
    p.add_argument("--steps", type=int, default=2, help="steps per run, the first is warm-up (2)")
    p.add_argument("--host-budget", default="512MiB", help="aidaptiv host budget (512MiB)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated ({','.join(VARIANTS)})")
    p.add_argument("--swap-root", default=os.path.join(ROOT, "swap"), help="where swap folders are made")
    p.add_argument(
        "--out",
        help="folder for rows.jsonl (default bench/results/activation_memory/<model>)",
    )
    args = p.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "activation_memory", args.model)
    env, machine, sha, dirty = bench_setup(ROOT, args.swap_root, args.out)
    print(summary(machine), file=sys.stderr)
    print(
        "| variant | seq | status | peak RSS MiB | step s | fwd / bwd s | activation I/O wait s | stored MiB (all steps) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with open(os.path.join(args.out, "rows.jsonl"), "a") as out:
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            for variant in args.variants.split(","):
                row = run_one(variant, seq_len, args, args.swap_root, env)
                row.update(
                    git_sha=sha,
                    git_dirty=dirty,
                    time=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    machine=machine,
                    model=args.model,
                    steps=args.steps,
                    host_budget=args.host_budget,
                )
                out.write(json.dumps(row) + "\n")
                out.flush()
                m = row.get("metrics") or {}
                ph = m.get("phases_s") or {}
                a = m.get("activations") or {}

                def f(v, scale=1.0, digits=2):
                    return "-" if v is None else f"{v * scale:.{digits}f}"

                print(
                    f"| {variant} | {seq_len} | {m.get('status', row.get('error'))} | {f(m.get('peak_rss_mb'), 1, 0)} "
                    f"| {f(m.get('step_s_median'))} | {f(ph.get('forward'))} / {f(ph.get('backward'))} "
                    f"| {f(ph.get('activation_io_wait'), 1, 3)} | {f(a.get('bytes_stored'), 2**-20, 1)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
