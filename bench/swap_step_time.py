#!/usr/bin/env python3
"""Step time of our swapper against ZeRO-Infinity on one machine, in one run (issue 3's target).

Conditions: the `tiny` preset (58M-parameter Llama shape: hidden 768, 6 layers), fp32, micro-batch 2 x
sequence 64, one CPU process, parameters and optimizer state on NVMe. ZeRO-Infinity runs
ds_configs/zero_infinity.json as shipped (its best settings, explained in ds_configs/README.md); ours runs
ds_configs/aidaptiv.json with the host budget capped at a fraction (default a quarter) of the model
state, so most of the state really moves through the disk every step. In-memory ZeRO-3
(ds_configs/zero3.json) runs alongside as the compute-only reference. Backends are interleaved over the
repeats; every figure comes from the runs' own metrics files.

    python bench/swap_step_time.py [--repeats 3] [--steps 12] [--out bench/results/swap_step_time]

Writes one JSON row per run to OUT/rows.jsonl and a summary (medians over repeats) to OUT/summary.md.
Every run here is our train job; bench/user_paths.py measures the same backends through a plain zero.Init
script and the Hugging Face Trainer as well.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from aidaptiv_ds.harness.machine import summary  # noqa: E402
from train_run import add_run_arguments, bench_setup, run_train  # noqa: E402  (bench/train_run.py)
from aidaptiv_ds.sizes import state_bytes_per_param  # noqa: E402

# fp32 ZeRO-3 with the optimizer offloaded keeps, per parameter: the parameter, its gradient, an fp32 master
# and two Adam moments (20 bytes).
STATE_BYTES_PER_PARAM = state_bytes_per_param(4)


def run_one(backend, args, swap_root, env):
    swap = tempfile.mkdtemp(prefix=f"{backend}-", dir=swap_root)
    metrics = os.path.join(swap, "metrics.json")
    cmd = [sys.executable, "-m", "aidaptiv_ds", "train", "--config", os.path.join(ROOT, "ds_configs", f"{backend}.json"),
           "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--nvme-path", swap,
           "--metrics-out", metrics, "--no-progress"]
    if backend == "aidaptiv":
        cmd += ["--host-budget", str(args.budget_bytes)]
    return run_train(cmd, ROOT, env, swap, metrics, backend=backend)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, 3, "runs per backend")
    p.add_argument("--backends", default="zero_infinity,aidaptiv,zero3",
                   help="comma-separated backends (default: zero_infinity,aidaptiv,zero3)")
    p.add_argument("--swap-root", default=os.path.join(ROOT, "swap"), help="where swap folders are made")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "swap_step_time"),
                   help="folder for rows.jsonl and summary.md (bench/results/swap_step_time)")
    args = p.parse_args()

    from aidaptiv_ds.models import count_parameters, preset_config
    params = count_parameters(preset_config(args.model))
    args.budget_bytes = int(params * STATE_BYTES_PER_PARAM * args.budget_fraction)
    env, machine, sha, dirty = bench_setup(ROOT, args.swap_root, args.out)
    print(summary(machine), file=sys.stderr)
    print(f"model {args.model}: {params / 1e6:.2f}M parameters, state {params * STATE_BYTES_PER_PARAM / 2**20:.0f} MiB,"
          f" aidaptiv host budget {args.budget_bytes / 2**20:.0f} MiB", file=sys.stderr)
    disk = measure_disk(args, env)
    print(f"disk (O_DIRECT, 1 MiB blocks, queue depth 32): read {disk.get('read_gbps')} GB/s, write "
          f"{disk.get('write_gbps')} GB/s", file=sys.stderr)
    backends = args.backends.split(",")
    rows = []
    with open(os.path.join(args.out, "rows.jsonl"), "a") as out:
        for rep in range(args.repeats):
            for b in (backends if rep % 2 == 0 else backends[::-1]):  # alternate the order too
                row = run_one(b, args, args.swap_root, env)
                row.update(repeat=rep, git_sha=sha, git_dirty=dirty, time=time.strftime("%Y-%m-%dT%H:%M:%S"), disk=disk,
                           machine=machine, model=args.model, params=params, seq_len=args.seq_len,
                           micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup,
                           budget_bytes=args.budget_bytes if b == "aidaptiv" else None)
                out.write(json.dumps(row) + "\n")
                out.flush()
                rows.append(row)
                m = row.get("metrics") or {}
                print(f"repeat {rep} {b:14s} step {m.get('step_s_median', float('nan')):.3f} s "
                      f"rss {m.get('peak_rss_mb', float('nan')):.0f} MiB {row.get('error', '')}", file=sys.stderr)
    text = summarize(rows, args, params, machine, sha, disk)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)


def measure_disk(args, env):
    """Read and write bandwidth of the swap disk with our engine, measured now (the bound's denominator)."""
    p = subprocess.run([sys.executable, "-m", "aidaptiv_ds", "io-bench", "--dir", args.swap_root, "--size-mb", "1024",
                        "--engines", "uring", "--repeat", "2", "--json"], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    try:
        e = json.loads(p.stdout)["engines"]["uring"]
        return {"read_gbps": e["read_gbps"], "write_gbps": e["write_gbps"]}
    except (ValueError, KeyError):
        return {"error": (p.stderr or p.stdout).strip()[-300:]}


def summarize(rows, args, params, machine, sha, disk):
    def med(b, key, sub=None):
        vals = []
        for r in rows:
            m = r.get("metrics") or {}
            if r["backend"] != b or m.get("status") != "ok":
                continue
            v = (m.get(key) or {}).get(sub) if sub else m.get(key)
            if v is not None:
                vals.append(v)
        return statistics.median(vals) if vals else None

    def fmt(v, scale=1.0, digits=3):
        return "-" if v is None else f"{v * scale:.{digits}f}"

    steps_timed = args.steps - args.warmup
    lines = [f"# Swapped step time, {args.model} ({params / 1e6:.1f}M params), fp32, micro-batch {args.micro_batch} x "
             f"seq {args.seq_len}, 1 CPU process", "",
             f"Machine: {summary(machine)}  ", f"git {sha}; {args.repeats} interleaved repeats, medians; "
             f"{args.steps} steps per run, first {args.warmup} excluded; aidaptiv host budget "
             f"{args.budget_bytes / 2**20:.0f} MiB = {args.budget_fraction:g} x model state.", "",
             "| backend | step s | forward s | backward s | optimizer s | of which updates s | I/O wait s | "
             "NVMe read MB/step | NVMe write MB/step | peak RSS MiB | peak pinned MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in args.backends.split(","):
        rd, wr = med(b, "nvme_read_bytes"), med(b, "nvme_write_bytes")
        lines.append(f"| {b} | {fmt(med(b, 'step_s_median'))} | {fmt(med(b, 'phases_s', 'forward'))} | "
                     f"{fmt(med(b, 'phases_s', 'backward'))} | {fmt(med(b, 'phases_s', 'optimizer'))} | "
                     f"{fmt(med(b, 'phases_s', 'optimizer_update'))} | "
                     f"{fmt(med(b, 'phases_s', 'io_wait'))} | {fmt(rd and rd / steps_timed, 1e-6, 0)} | "
                     f"{fmt(wr and wr / steps_timed, 1e-6, 0)} | {fmt(med(b, 'peak_rss_mb'), 1, 0)} | "
                     f"{fmt(med(b, 'peak_pinned_mb'), 1, 0)} |")
    a, z = med("aidaptiv", "step_s_median"), med("zero_infinity", "step_s_median")
    if a and z:
        lines += ["", f"aidaptiv / ZeRO-Infinity median step time: **{a / z:.2f}x** (target <= 0.70x)."]
    ra, rz = med("aidaptiv", "peak_rss_mb"), med("zero_infinity", "peak_rss_mb")
    if ra and rz:
        lines.append(f"Peak host RSS: aidaptiv {ra:.0f} MiB vs ZeRO-Infinity {rz:.0f} MiB ({ra / rz:.2f}x).")
    rd, wr, compute = med("aidaptiv", "nvme_read_bytes"), med("aidaptiv", "nvme_write_bytes"), med("zero3", "step_s_median")
    if rd and wr and disk.get("read_gbps") and disk.get("write_gbps") and compute and a:
        io = rd / steps_timed / (disk["read_gbps"] * 1e9) + wr / steps_timed / (disk["write_gbps"] * 1e9)
        lines += ["", "Distance to the bound (DESIGN.md): a step cannot be faster than max(compute, NVMe time).",
                  f"Compute: in-memory ZeRO-3 step {compute:.3f} s. NVMe time of aidaptiv's bytes at the disk's "
                  f"bandwidth measured in this run ({disk['read_gbps']:.2f} GB/s read, {disk['write_gbps']:.2f} "
                  f"GB/s write, one after the other): {io:.3f} s. Bound {max(compute, io):.3f} s; measured "
                  f"{a:.3f} s ({a / max(compute, io):.2f}x the bound); the rest is I/O that did not overlap "
                  "compute (the I/O wait column).",
                  "With fp32 models aidaptiv applies each update when the next forward fetches the parameters "
                  "(\"of which updates\"): its forward includes the optimizer's work, and its optimizer column "
                  "is only what engine.step() takes."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
