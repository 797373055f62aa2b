#!/usr/bin/env python3
"""What aidaptiv's two heap settings cost and save: the same `aidaptiv-ds train` run with the shipped settings
(glibc's mmap threshold fixed at 1 MiB when the swapper starts, and on the CPU the heap trimmed at the end of
each forward, backward, optimizer step and backward layer group: trim_heap "auto") against variants:
the heap not trimmed, glibc's dynamic threshold (0), and the threshold held at 128 KiB (glibc's starting
value: activations of a few hundred KiB are mapped and unmapped too instead of fragmenting the heap).
Interleaved, order alternating per repeat; step time and peak RSS from each run's metrics.

Conditions as bench/swap_step_time.py (tiny, fp32, 2 x 64, one CPU process) with the host budget at 0.6 of
the model state, as that bench's equal-memory comparison; --model and --budget-fraction change them.

    python bench/heap_settings.py [--repeats 3] [--variants shipped,untrimmed,dynamic,128KiB]
                                     [--out bench/results/heap_settings/tiny]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from train_run import add_run_arguments, bench_setup, run_interleaved, run_train  # noqa: E402  (bench/train_run.py)

from aidaptiv_ds.common.sizes import state_bytes_per_param  # noqa: E402
from aidaptiv_ds.harness.machine import summary  # noqa: E402

# --variants name: (the row's label, the block's settings)
VARIANTS = {
    "shipped": ("threshold 1 MiB, heap trimmed (shipped)", {"malloc_mmap_threshold": "1MiB", "trim_heap": "auto"}),
    "untrimmed": ("threshold 1 MiB, not trimmed", {"malloc_mmap_threshold": "1MiB", "trim_heap": False}),
    "dynamic": ("glibc's dynamic threshold (0), not trimmed", {"malloc_mmap_threshold": 0, "trim_heap": False}),
    "128KiB": ("threshold 128 KiB, heap trimmed", {"malloc_mmap_threshold": "128KiB", "trim_heap": "auto"}),
}
LABELS = {label: settings for label, settings in VARIANTS.values()}


def run_one(name, args, env):
    swap = tempfile.mkdtemp(prefix="malloc-", dir=args.swap_root)
    with open(os.path.join(ROOT, "ds_configs", "aidaptiv.json")) as f:
        cfg = json.load(f)
    cfg["aidaptiv"].update(LABELS[name])
    config = os.path.join(swap, "aidaptiv.json")
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
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--nvme-path",
        swap,
        "--metrics-out",
        metrics,
        "--no-progress",
        "--host-budget",
        str(args.budget_bytes),
    ]
    return run_train(cmd, ROOT, env, swap, metrics, variant=name)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, 3, "runs per setting")
    p.set_defaults(budget_fraction=0.6)
    p.add_argument("--swap-root", default=os.path.join(ROOT, "swap"), help="where swap folders are made")
    p.add_argument(
        "--out",
        help="folder for rows.jsonl and summary.md (default bench/results/heap_settings/<model>)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated settings to compare, of " + ", ".join(VARIANTS) + " (all)",
    )
    args = p.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "heap_settings", args.model)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"unknown --variants {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    from aidaptiv_ds.models.presets import count_parameters, preset_config

    params = count_parameters(preset_config(args.model))
    args.budget_bytes = int(params * state_bytes_per_param(4) * args.budget_fraction)
    env, machine, sha, dirty = bench_setup(ROOT, args.swap_root, args.out)
    names = [VARIANTS[v][0] for v in args.variants.split(",")]
    rows = run_interleaved(
        names,
        args.repeats,
        lambda name: run_one(name, args, env),
        os.path.join(args.out, "rows.jsonl"),
        dict(
            git_sha=sha,
            git_dirty=dirty,
            machine=machine,
            model=args.model,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            steps=args.steps,
            warmup=args.warmup,
            budget_bytes=args.budget_bytes,
        ),
    )
    lines = [
        "# Host heap settings: aidaptiv.malloc_mmap_threshold and aidaptiv.trim_heap",
        "",
        f"Machine: {summary(machine)}  ",
        f"git {sha}{' (dirty)' if dirty else ''}; {args.model}, fp32, "
        f"{args.micro_batch} x {args.seq_len}, {args.steps} steps (first {args.warmup} untimed), host budget "
        f"{args.budget_bytes / 2**20:.0f} MiB; {args.repeats} interleaved repeats.",
        "",
        "| setting | step s (median, min-max) | peak RSS MiB (median, min-max) | heap trims / step | s trimming / step |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        ok = [r["metrics"] for r in rows if r["variant"] == name and (r.get("metrics") or {}).get("status") == "ok"]
        if not ok:
            lines.append(f"| {name} | - | - | - | - |")
            continue
        st, rss = [m["step_s_median"] for m in ok], [m["peak_rss_mb"] for m in ok]
        sw = [m.get("swapper") or {} for m in ok]
        trims = statistics.median([s.get("heap_trims", 0) / args.steps for s in sw])
        trim_s = statistics.median([s.get("heap_trim_s", 0.0) / args.steps for s in sw])
        lines.append(
            f"| {name} | {statistics.median(st):.3f} ({min(st):.3f}-{max(st):.3f}) | "
            f"{statistics.median(rss):.0f} ({min(rss):.0f}-{max(rss):.0f}) | {trims:.1f} | {trim_s:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
