#!/usr/bin/env python3
"""The train job's step at an earlier commit against the working tree, in one run: does a change slow the step?

Both sides run the same `python -m aidaptiv_ds train` (the `tiny` preset by default, fp32, the aidaptiv block
with the host budget capped at a fraction of the model state, so that the state really moves through the disk),
each from its own source tree: the baseline from a temporary git worktree of ``--baseline`` (removed at the
end), the candidate from this repository as it is. The C++ engine is the same build on both sides (the
baseline's tree gets a copy of this tree's extension module, refused when the engine's sources differ between
the two), so what is compared is the Python around it. The sides are interleaved, their order alternating per
repeat; every figure comes from the runs' own metrics files (``step_s_median``: the median step after the
warm-up).

    python bench/step_regression.py --baseline b9c5b9a [--repeats 5] [--steps 12] [--out DIR]

Writes one JSON row per run to OUT/rows.jsonl (started afresh) and OUT/summary.md: each side's median step over
the repeats with its min-max, and the candidate/baseline ratio per repeat.
"""

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from train_run import add_run_arguments, bench_setup, paired_ratios, run_interleaved, run_train  # noqa: E402

from aidaptiv_ds.common.sizes import state_bytes_per_param  # noqa: E402
from aidaptiv_ds.harness.machine import summary  # noqa: E402

SIDES = ("baseline", "candidate")
ENGINE_SOURCES = ("csrc", "setup.py")  # what the extension module is built from


def git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def baseline_tree(rev: str, parent: str) -> str:
    """A detached worktree of ``rev`` with this tree's extension module copied in (same engine sources only)."""
    sources = [s for s in ENGINE_SOURCES if os.path.exists(os.path.join(ROOT, s))]
    # comment lines aside (-I): a reworded comment builds the same module
    if git("diff", "--stat", "-I", r"^\s*(//|/\*|\*|#)", rev, "--", *sources):
        sys.exit(f"step_regression: the engine's sources differ between {rev} and the working tree: build each side")
    tree = os.path.join(parent, "baseline")
    git("worktree", "add", "--detach", tree, rev)
    built = glob.glob(os.path.join(ROOT, "aidaptiv_ds", "engine", "_C*.so"))
    if not built:
        sys.exit("step_regression: build the engine first (bash scripts/setup.sh)")
    for so in built:
        shutil.copy2(so, os.path.join(tree, "aidaptiv_ds", "engine"))
    return tree


def run_one(side, tree, args, env):
    swap = tempfile.mkdtemp(prefix=f"{side}-", dir=args.swap_root)
    metrics = os.path.join(swap, "metrics.json")
    cmd = [sys.executable, "-m", "aidaptiv_ds", "train", "--config", os.path.join(tree, "ds_configs", "aidaptiv.json")]
    cmd += ["--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--nvme-path", swap]
    cmd += ["--host-budget", str(args.budget_bytes), "--metrics-out", metrics, "--no-progress"]
    side_env = dict(env, PYTHONPATH=tree)  # this side's package first, whatever is installed
    return run_train(cmd, tree, side_env, swap, metrics, side=side)


def write_summary(rows, args, machine, sha, dirty):
    steps = {}
    for r in rows:
        m = r.get("metrics") or {}
        if m.get("status") == "ok" and m.get("step_s_median"):
            steps[(r["side"], r["repeat"])] = m["step_s_median"]
    lines = [
        f"# Step time at {args.baseline} against the working tree ({sha[:10]}{' + changes' if dirty else ''})",
        "",
        f"{summary(machine)}",
        "",
        f"`{args.model}`, sequence {args.seq_len}, micro-batch {args.micro_batch}, {args.steps} steps "
        f"({args.warmup} of warm-up left out), fp32, aidaptiv host budget {args.budget_bytes / 2**20:.0f} MiB "
        f"({args.budget_fraction:g} of the model state), {args.repeats} repeats interleaved.",
        "",
        "| side | runs ok | median step (s) | min-max (s) |",
        "| --- | --- | --- | --- |",
    ]
    for side in SIDES:
        got = [v for (s, _), v in steps.items() if s == side]
        if got:
            lines.append(f"| {side} | {len(got)} | {statistics.median(got):.3f} | {min(got):.3f}-{max(got):.3f} |")
        else:
            lines.append(f"| {side} | 0 | - | - |")
    ratios = paired_ratios(steps, "candidate", "baseline")
    if ratios:
        lines += [
            "",
            f"candidate/baseline step, per repeat: {', '.join(f'{x:.3f}' for x in ratios)}; median "
            f"{statistics.median(ratios):.3f} (below 1: the working tree is faster).",
        ]
    failed = [r for r in rows if (r.get("metrics") or {}).get("status") != "ok"]
    for r in failed:
        lines.append(
            f"- {r['side']} repeat {r['repeat']} failed: {r.get('error') or (r.get('metrics') or {}).get('error')}"
        )
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, 5, "runs per side")
    p.set_defaults(budget_fraction=0.6)
    p.add_argument("--baseline", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--swap-root", default=os.path.join(ROOT, "swap"), help="where swap folders are made")
    p.add_argument("--out", help="folder for rows.jsonl and summary.md (default bench/results/step_regression/<model>)")
    args = p.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "step_regression", args.model)

    from aidaptiv_ds.models.presets import count_parameters, preset_config

    params = count_parameters(preset_config(args.model))
    args.budget_bytes = int(params * state_bytes_per_param(4) * args.budget_fraction)
    env, machine, sha, dirty = bench_setup(ROOT, args.swap_root, args.out)
    print(summary(machine), file=sys.stderr)
    parent = tempfile.mkdtemp(prefix="step-regression-")
    tree = baseline_tree(args.baseline, parent)
    try:
        trees = {"baseline": tree, "candidate": ROOT}
        common = dict(git_sha=sha, git_dirty=dirty, baseline=git("rev-parse", args.baseline), machine=machine)
        common.update(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch, steps=args.steps)
        common.update(warmup=args.warmup, budget_bytes=args.budget_bytes)
        rows_path = os.path.join(args.out, "rows.jsonl")
        open(rows_path, "w").close()
        rows = run_interleaved(list(SIDES), args.repeats, lambda s: run_one(s, trees[s], args, env), rows_path, common)
    finally:
        git("worktree", "remove", "--force", tree)
        shutil.rmtree(parent, ignore_errors=True)
    write_summary(rows, args, machine, sha, dirty)


if __name__ == "__main__":
    main()
