#!/usr/bin/env python3
"""A long sequence with the shipped config, without naming a policy: does it train under a memory cap?

`aidaptiv-ds train --config ds_configs/aidaptiv.json --model tiny --seq-len 12000 --micro-batch 1` three ways:
with the config's activations policy set to "keep" (what the job did before it planned a block without a
policy with "auto"), uncapped and under a memory cgroup of --cap-gib, and the shipped config as is (no policy
named: the train job runs "auto") under the same cap.
Each run's exit, peak RSS (the job's), the cgroup's peak and OOM kills, step time and the auto policy's plan line.

    python bench/long_sequence.py [--seq-len 12000] [--cap-gib 5] [--steps 2] [--out bench/results/long_sequence/tiny]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from aidaptiv_ds.harness.hostcap import probe_cgroup  # noqa: E402
from aidaptiv_ds.harness.machine import machine_info, summary  # noqa: E402


def run(name, config, args, cap, factory, work):
    metrics = os.path.join(work, f"{name}.json")
    cmd = [sys.executable, "-m", "aidaptiv_ds", "train", "--config", config, "--model", args.model, "--seq-len",
           str(args.seq_len), "--micro-batch", "1", "--steps", str(args.steps), "--warmup", "0", "--no-progress",
           "--metrics-out", metrics]  # fmt: skip
    cg = factory.create(f"aidaptiv-longseq-{os.getpid()}-{name}", cap) if cap else None
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cg.wrap(cmd) if cg else cmd, capture_output=True, text=True, cwd=work, env=env)
        peak, ooms = (cg.peak_bytes(), cg.oom_kills()) if cg else (None, 0)
    finally:
        if cg:
            cg.remove()
    out = p.stdout + p.stderr
    row = {
        "run": name,
        "rc": p.returncode,
        "cap_gib": cap / (1 << 30) if cap else None,
        "cgroup_peak_bytes": peak,
        "oom_kills": ooms,
        "wall_s": time.perf_counter() - t0,
        "plan": next((ln for ln in out.splitlines() if "activations auto:" in ln), None),
        "status": next((ln for ln in out.splitlines() if "status=" in ln), out[-600:]),
    }
    if p.returncode == 0 and os.path.exists(metrics):
        m = json.load(open(metrics))
        row.update(peak_rss_mb=m.get("peak_rss_mb"), step_s=m.get("step_s_median"), losses=m.get("losses"))
    print(json.dumps({k: row[k] for k in ("run", "rc", "oom_kills", "cgroup_peak_bytes")}), file=sys.stderr)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=12000)
    ap.add_argument("--cap-gib", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--summary-only", action="store_true", help="write OUT/summary.md from OUT/rows.jsonl")
    ap.add_argument("--out", help="folder for rows.jsonl and summary.md (default bench/results/long_sequence/<model>)")
    args = ap.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "long_sequence", args.model)
    factory, where = probe_cgroup()
    if factory is None:
        sys.exit(f"no usable memory cgroup: {where}")
    os.makedirs(args.out, exist_ok=True)
    cap = int(args.cap_gib * (1 << 30))
    rows = []
    if args.summary_only:
        rows = [json.loads(line) for line in open(os.path.join(args.out, "rows.jsonl"))]
        write_summary(args, rows, rows[0]["machine"])
        return
    with tempfile.TemporaryDirectory(dir=ROOT, prefix=".longseq-") as work:
        shipped = json.load(open(os.path.join(ROOT, "ds_configs", "aidaptiv.json")))
        keep = json.loads(json.dumps(shipped))
        keep["aidaptiv"]["activations"] = {"policy": "keep"}
        keep_path = os.path.join(work, "keep.json")
        json.dump(keep, open(keep_path, "w"))
        shipped_path = os.path.join(ROOT, "ds_configs", "aidaptiv.json")
        rows.append(run("keep_uncapped", keep_path, args, None, factory, work))
        rows.append(run("keep_capped", keep_path, args, cap, factory, work))
        rows.append(run("shipped_auto_capped", shipped_path, args, cap, factory, work))
        machine = summary(machine_info(work))
    with open(os.path.join(args.out, "rows.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(dict(r, machine=machine, seq_len=args.seq_len, model=args.model)) + "\n")
    write_summary(args, rows, machine)


def write_summary(args, rows, machine):
    lines = [
        f"# A long sequence with the shipped config under a memory cap ({time.strftime('%Y-%m-%d')})",
        "",
        f"`aidaptiv-ds train --config ds_configs/aidaptiv.json --model {args.model} --seq-len {args.seq_len} "
        f'--micro-batch 1 --steps {args.steps}`; the keep runs replace the config\'s activations policy by "keep"; '
        f"cap: a memory cgroup of {args.cap_gib:g} GiB (page cache charged). Machine: {machine}.",
        "",
        "| run | exit | peak RSS | cgroup peak | OOM kills | step s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = "-" if r["cgroup_peak_bytes"] is None else f"{r['cgroup_peak_bytes'] / (1 << 30):.2f} GiB"
        rss = f"{r['peak_rss_mb']:.0f} MB" if r.get("peak_rss_mb") else "-"
        step = f"{r['step_s']:.1f}" if r.get("step_s") else "-"
        lines.append(f"| {r['run']} | {r['rc']} | {rss} | {peak} | {r['oom_kills']} | {step} |")
    plan = rows[-1].get("plan")
    if plan:
        lines += ["", f"The auto policy's plan: {plan.split('activations auto: ', 1)[1]}"]
    flags = " ".join(a for a in sys.argv[1:] if a != "--summary-only")
    lines += ["", f"Command: `{('python bench/long_sequence.py ' + flags).strip()}`", ""]
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
