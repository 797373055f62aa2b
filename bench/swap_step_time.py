#!/usr/bin/env python3
"""Step time of our swapper against ZeRO-Infinity on one machine, in one run (issue 3's target).

Conditions: the `tiny` preset (58M-parameter Llama shape: hidden 768, 6 layers), fp32, micro-batch 2 x
sequence 64, one CPU process, parameters and optimizer state on NVMe. Ours runs ds_configs/aidaptiv.json with
the host budget capped at a fraction of the model state (default 0.6), so much of the state really moves
through the disk every step. ZeRO-Infinity runs twice: ds_configs/zero_infinity.json as shipped (its best
settings, explained in ds_configs/README.md; it pins more than our budget) and as zero_infinity_eqmem, the same
file with its RAM cache, swap buffers and sub-groups sized to exactly our host budget (harness/eqmem.py, as
the sweep does). The default fraction is 0.6 because below about 0.5 of tiny's state ZeRO-Infinity's fixed
host buffers alone exceed the budget and the memory cannot be equal (the summary says by how much when it is
not). In-memory ZeRO-3 (ds_configs/zero3.json) runs alongside as the compute-only reference. Backends are
interleaved over the repeats, their order alternating; every figure comes from the runs' own metrics files.

    python bench/swap_step_time.py [--repeats 5] [--steps 12] [--out bench/results/swap_step_time/tiny]

Writes one JSON row per run to OUT/rows.jsonl (started afresh) and a summary (medians over repeats) to OUT/summary.md.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from train_run import (  # noqa: E402  (bench/train_run.py)
    add_run_arguments,
    bench_setup,
    eqmem_sizing,
    paired_ratios,
    run_interleaved,
    run_train,
)

from aidaptiv_ds.common.sizes import state_bytes_per_param  # noqa: E402
from aidaptiv_ds.harness import eqmem  # noqa: E402
from aidaptiv_ds.harness.machine import summary  # noqa: E402

# fp32 ZeRO-3 with the optimizer offloaded keeps, per parameter: the parameter, its gradient, an fp32 master
# and two Adam moments (20 bytes).
STATE_BYTES_PER_PARAM = state_bytes_per_param(4)


BACKENDS = ("zero_infinity", eqmem.BACKEND, "aidaptiv", "zero3")


def config_path(backend, args, swap):
    if backend != eqmem.BACKEND:
        return os.path.join(ROOT, "ds_configs", f"{backend}.json")
    base, sizing = eqmem_sizing(ROOT, args.model, args.budget_bytes)
    path = os.path.join(swap, "ds_config.json")
    with open(path, "w") as f:
        json.dump(eqmem.eqmem_config(base, sizing), f, indent=1)
    return path


def run_one(backend, args, swap_root, env):
    swap = tempfile.mkdtemp(prefix=f"{backend}-", dir=swap_root)
    metrics = os.path.join(swap, "metrics.json")
    cmd = [
        sys.executable,
        "-m",
        "aidaptiv_ds",
        "train",
        "--config",
        config_path(backend, args, swap),
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
    ]
    if backend == "aidaptiv":
        cmd += ["--host-budget", str(args.budget_bytes)]
    return run_train(cmd, ROOT, env, swap, metrics, backend=backend)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, 5, "runs per backend")
    p.set_defaults(budget_fraction=0.6)
    p.add_argument(
        "--backends", default=",".join(BACKENDS), help=f"comma-separated, from {', '.join(BACKENDS)} (default: all)"
    )
    p.add_argument("--swap-root", default=os.path.join(ROOT, "swap"), help="where swap folders are made")
    p.add_argument(
        "--out",
        help="folder for rows.jsonl and summary.md (default bench/results/swap_step_time/<model>)",
    )
    p.add_argument(
        "--summary-only",
        action="store_true",
        help="write OUT/summary.md again from OUT/rows.jsonl and OUT/bound.json (give the run's arguments)",
    )
    args = p.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "swap_step_time", args.model)
    bad = [b for b in args.backends.split(",") if b not in BACKENDS]
    if bad:
        p.error(f"--backends {','.join(bad)}: choose from {', '.join(BACKENDS)}")

    from aidaptiv_ds.models.presets import count_parameters, preset_config

    params = count_parameters(preset_config(args.model))
    args.budget_bytes = int(params * STATE_BYTES_PER_PARAM * args.budget_fraction)
    if args.summary_only:
        return summary_only(args)
    env, machine, sha, dirty = bench_setup(ROOT, args.swap_root, args.out)
    print(summary(machine), file=sys.stderr)
    print(
        f"model {args.model}: {params / 1e6:.2f}M parameters, state {params * STATE_BYTES_PER_PARAM / 2**20:.0f} MiB,"
        f" aidaptiv host budget {args.budget_bytes / 2**20:.0f} MiB",
        file=sys.stderr,
    )
    sizing = eqmem_sizing(ROOT, args.model, args.budget_bytes)[1] if eqmem.BACKEND in args.backends.split(",") else None
    if sizing is not None:
        print(
            f"{eqmem.BACKEND}: max_in_cpu {sizing.max_in_cpu:,} of {sizing.partition_numel:,} elements, "
            f"sub_group_size {sizing.sub_group_size:,}, {sizing.sized_bytes / 2**20:.0f} MiB sized"
            + (f", {sizing.over_budget_bytes / 2**20:.0f} MiB over the budget" if sizing.over_budget_bytes else ""),
            file=sys.stderr,
        )
    disk = measure_disk(args, env)
    print(
        f"disk (O_DIRECT, 1 MiB blocks, queue depth 32): read {disk.get('read_gbps')} GB/s, write "
        f"{disk.get('write_gbps')} GB/s",
        file=sys.stderr,
    )
    backends = args.backends.split(",")
    common = dict(
        git_sha=sha,
        git_dirty=dirty,
        disk=disk,
        machine=machine,
        model=args.model,
        params=params,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        steps=args.steps,
        warmup=args.warmup,
    )
    # One run's rows: its bound.json and summary describe it alone (--summary-only reads every row of the file).
    open(os.path.join(args.out, "rows.jsonl"), "w").close()
    rows = run_interleaved(
        backends,
        args.repeats,
        lambda b: run_one(b, args, args.swap_root, env),
        os.path.join(args.out, "rows.jsonl"),
        common,
        lambda b: dict(
            budget_bytes=args.budget_bytes if b in ("aidaptiv", eqmem.BACKEND) else None,
            eqmem=sizing.as_row() if b == eqmem.BACKEND else None,
        ),
    )
    ok_zero3 = any(r["backend"] == "zero3" and (r.get("metrics") or {}).get("status") == "ok" for r in rows)
    bound = {
        "disk_before": disk,
        "disk_after": measure_disk(args, env),
        # where in-memory ZeRO-3 did not run (or ran out of memory) the compute term is estimated
        "compute_estimate": None if ok_zero3 else dict(zip(("seconds", "how"), estimated_compute(args))),
    }
    with open(os.path.join(args.out, BOUND_FILE), "w") as f:
        json.dump(bound, f, indent=1)
    write_summary(rows, args, params, machine, sha, sizing, bound)


BOUND_FILE = "bound.json"  # what the bound was made of, beside rows.jsonl: the disk before and after, the estimate


def bound_disk(bound: dict) -> dict:
    """The bound's denominator: the mean of the disk measured before and after the runs, with both kept."""
    before, after = bound.get("disk_before") or {}, bound.get("disk_after") or {}
    disk = dict(before)
    for k in ("read_gbps", "write_gbps"):
        if before.get(k) and after.get(k):
            disk[k + "_runs"] = [before[k], after[k]]
            disk[k] = (before[k] + after[k]) / 2
    return disk


def write_summary(rows, args, params, machine, sha, sizing, bound):
    estimate = bound.get("compute_estimate")
    estimate = (estimate["seconds"], estimate["how"]) if estimate else None
    text = summarize(rows, args, params, machine, sha, bound_disk(bound), sizing, estimate)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)


def summary_only(args):
    """summary.md again from OUT/rows.jsonl and OUT/bound.json, with the run's arguments (no run)."""
    with open(os.path.join(args.out, "rows.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(args.out, BOUND_FILE)) as f:
        bound = json.load(f)
    first = rows[0]
    args.budget_bytes = first.get("budget_bytes") or args.budget_bytes
    sizing = eqmem_sizing(ROOT, args.model, args.budget_bytes)[1] if eqmem.BACKEND in args.backends.split(",") else None
    write_summary(rows, args, first["params"], first["machine"], first["git_sha"], sizing, bound)


def measure_disk(args, env):
    """Read and write bandwidth of the swap disk with our engine, measured now (the bound's denominator)."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "aidaptiv_ds",
            "io-bench",
            "--nvme-path",
            args.swap_root,
            "--size-mb",
            "1024",
            "--engines",
            "uring",
            "--repeat",
            "2",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    try:
        e = json.loads(p.stdout)["engines"]["uring"]
        return {"read_gbps": e["read_gbps"], "write_gbps": e["write_gbps"]}
    except (ValueError, KeyError):
        return {"error": (p.stderr or p.stdout).strip()[-300:]}


def estimated_compute(args):
    """(seconds, how) of one step's arithmetic on this CPU where in-memory ZeRO-3 cannot run it (the state does not
    fit the RAM): the step's FLOPs at the matmul rate and the parameters at the AdamW rate, both measured now
    (planner/rates.py's probe), on the same cores one after the other."""
    from aidaptiv_ds.planner.memory import Job, step_flops
    from aidaptiv_ds.planner.rates import probe_cpu
    from aidaptiv_ds.planner.shapes import resolve_shape

    rates = probe_cpu("fp32")
    shape = resolve_shape(args.model)
    flops = step_flops(Job(shape, args.seq_len, args.micro_batch, dtype="fp32"))
    seconds = flops / rates["cpu_flops"] + shape.num_parameters / rates["cpu_adam"]
    how = (
        f"{flops / 1e12:.2f} TFLOP at {rates['cpu_flops'] / 1e9:.0f} GFLOP/s (fp32 1024-square matmul) and "
        f"{shape.num_parameters / 1e9:.2f}B parameters at {rates['cpu_adam'] / 1e6:.0f}M/s (foreach AdamW), "
        "measured in this run"
    )
    return seconds, how


def overlap_note(step_bytes, step_s, busy, disk) -> str:
    """Where the disk moved the step's bytes faster while busy than it reads or writes alone, reads and writes
    overlapped on it, and the one-after-the-other NVMe time is not a floor."""
    if not busy or not step_s:
        return ""
    rate = step_bytes / (busy * step_s) / 1e9
    if rate <= max(disk["read_gbps"], disk["write_gbps"]):
        return ""
    return (
        f" While busy the disk moved the step's bytes at {rate:.2f} GB/s, more than it reads or writes alone: reads "
        "and writes overlap on it, so the one-after-the-other NVMe time is the bound asked for, not a floor."
    )


def figures(rows, key):
    """{(backend, repeat): the run's metric} of the runs that went ok."""
    out = {}
    for r in rows:
        m = r.get("metrics") or {}
        if m.get("status") == "ok" and m.get(key) is not None:
            out[(r["backend"], r["repeat"])] = m[key]
    return out


def summarize(rows, args, params, machine, sha, disk, sizing=None, compute_estimate=None):
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

    def busy_fraction(b):
        """Median over runs of the swap disk's busy share of the timed steps (the train job's disk_busy)."""
        vals = [
            ((r.get("metrics") or {}).get("disk_busy") or [{}])[0].get("fraction")
            for r in rows
            if r["backend"] == b and (r.get("metrics") or {}).get("status") == "ok"
        ]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    def busy(b):
        f = busy_fraction(b)
        return "-" if f is None else f"{f:.0%}"

    def fmt(v, scale=1.0, digits=3):
        return "-" if v is None else f"{v * scale:.{digits}f}"

    def ratio(num, den, key, what, target):
        rs = paired_ratios(figures(rows, key), num, den)
        if not rs:
            return []
        return [
            f"- {what}: **{statistics.median(rs):.2f}x** median over {len(rs)} repeat pairs "
            f"(min {min(rs):.2f}x, max {max(rs):.2f}x){target}"
        ]

    backends = args.backends.split(",")
    steps_timed = args.steps - args.warmup
    lines = [
        f"# Swapped step time, {args.model} ({params / 1e6:.1f}M params), fp32, micro-batch {args.micro_batch} x "
        f"seq {args.seq_len}, 1 CPU process",
        "",
        f"Machine: {summary(machine)}  ",
        f"git {sha}; {args.repeats} interleaved repeats, medians; "
        f"{args.steps} steps per run, first {args.warmup} excluded; aidaptiv host budget "
        f"{args.budget_bytes / 2**20:.0f} MiB = {args.budget_fraction:g} x model state.",
        "",
    ]
    if sizing is not None:
        lines += [
            f"{eqmem.BACKEND}: ds_configs/zero_infinity.json with max_in_cpu {sizing.max_in_cpu:,} of "
            f"{sizing.partition_numel:,} elements, sub_group_size {sizing.sub_group_size:,}, parameter buffers "
            f"{sizing.param_buffer_count} x {sizing.param_buffer_size:,}: {sizing.sized_bytes / 2**20:.0f} MiB "
            f"of host memory for the model state against aidaptiv's {sizing.budget_bytes / 2**20:.0f} MiB"
            + (
                f" ({sizing.over_budget_bytes / 2**20:.0f} MiB over: its fixed buffers alone exceed the budget)"
                if sizing.over_budget_bytes
                else ""
            )
            + ". zero_infinity is the shipped file (no RAM cache, "
            "5 parameter buffers of 1e8 elements).",
            "",
        ]
    lines += [
        "| backend | step s | forward s | backward s | optimizer s | of which updates s | I/O wait s | "
        "NVMe read MB/step | NVMe write MB/step | disk busy | peak RSS MiB | peak pinned MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in backends:
        rd, wr = med(b, "nvme_read_bytes"), med(b, "nvme_write_bytes")
        lines.append(
            f"| {b} | {fmt(med(b, 'step_s_median'))} | {fmt(med(b, 'phases_s', 'forward'))} | "
            f"{fmt(med(b, 'phases_s', 'backward'))} | {fmt(med(b, 'phases_s', 'optimizer'))} | "
            f"{fmt(med(b, 'phases_s', 'optimizer_update'))} | "
            f"{fmt(med(b, 'phases_s', 'io_wait'))} | {fmt(rd and rd / steps_timed, 1e-6, 0)} | "
            f"{fmt(wr and wr / steps_timed, 1e-6, 0)} | {busy(b)} | {fmt(med(b, 'peak_rss_mb'), 1, 0)} | "
            f"{fmt(med(b, 'peak_pinned_mb'), 1, 0)} |"
        )
    against = ["", "aidaptiv against ZeRO-Infinity, per repeat:"]
    against += ratio(
        "aidaptiv", eqmem.BACKEND, "step_s_median", "step time / equal-memory ZeRO-Infinity", " (target <= 0.5x)"
    )
    against += ratio(
        "aidaptiv", eqmem.BACKEND, "peak_rss_mb", "peak RSS / equal-memory ZeRO-Infinity", " (target <= 0.5x)"
    )
    against += ratio("aidaptiv", "zero_infinity", "step_s_median", "step time / shipped ZeRO-Infinity", "")
    against += ratio("aidaptiv", "zero_infinity", "peak_rss_mb", "peak RSS / shipped ZeRO-Infinity", "")
    if len(against) > 2:  # a ZeRO-Infinity side ran
        lines += against
    a = med("aidaptiv", "step_s_median")
    rd, wr, compute = (
        med("aidaptiv", "nvme_read_bytes"),
        med("aidaptiv", "nvme_write_bytes"),
        med("zero3", "step_s_median"),
    )
    compute_how = (
        f"in-memory ZeRO-3 step {compute:.3f} s (on this CPU the optimizer runs on the same cores as the model, "
        "so its time is compute too)"
        if compute
        else None
    )
    if compute is None and compute_estimate is not None:
        compute, how = compute_estimate
        compute_how = f"{compute:.3f} s, estimated ({how}; in-memory ZeRO-3 cannot hold this model's state)"
    if rd and wr and disk.get("read_gbps") and disk.get("write_gbps") and compute and a:
        io = rd / steps_timed / (disk["read_gbps"] * 1e9) + wr / steps_timed / (disk["write_gbps"] * 1e9)
        measured = ""
        if disk.get("read_gbps_runs"):
            measured = (
                f", before and after the runs: read {' and '.join(f'{v:.2f}' for v in disk['read_gbps_runs'])}, "
                f"write {' and '.join(f'{v:.2f}' for v in disk['write_gbps_runs'])}"
            )
        lines += [
            "",
            "Distance to the bound (DESIGN.md): a step cannot be faster than max(compute, NVMe time).",
            f"Compute: {compute_how}. NVMe time of aidaptiv's bytes at the disk's "
            f"bandwidth measured in this run ({disk['read_gbps']:.2f} GB/s read, {disk['write_gbps']:.2f} "
            f"GB/s write{measured}; reads and writes one after the other): {io:.3f} s. Bound "
            f"{max(compute, io):.3f} s; measured {a:.3f} s (**{a / max(compute, io):.2f}x** the bound); the rest "
            "is I/O that did not overlap compute (the I/O wait column) and compute the disk did not overlap (the "
            "disk busy column: the share of the timed steps the swap disk had requests in flight)."
            + overlap_note(rd / steps_timed + wr / steps_timed, a, busy_fraction("aidaptiv"), disk),
            "With fp32 models aidaptiv applies each update when the next forward fetches the parameters "
            '("of which updates"): its forward includes the optimizer\'s work, and its optimizer column '
            "is only what engine.step() takes.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
