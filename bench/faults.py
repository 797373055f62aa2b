#!/usr/bin/env python3
"""Run the fault-injection suite's cases (tests/faults/cases.py) N times each and record one JSON row per run.

Every case is a whole training job (`aidaptiv-ds train`, micro preset, fp32, 6 steps, a checkpoint every 2)
with one fault injected in its 4th step, judged as tests/faults/cases.py says: no hang, no crash, a clear
error (file, errno, offset, what to do), and the last checkpoint resumed to the uninterrupted losses
(fp32, 1e-6 relative), so that "data lost" counts runs where a resume failed or drifted. The concurrent-swaps
case moves 128 extents through the swap store at once and compares every byte.

    python bench/faults.py [--runs 3] [--cases eio-read,kill9-step,...] [--out bench/results/faults/micro]

Writes OUT/rows.jsonl (appends); bench/readme_tables.py makes the README's table from it.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))

import cases  # noqa: E402

from aidaptiv_ds.harness.machine import machine_info, summary  # noqa: E402
from aidaptiv_ds.harness.results import git_state  # noqa: E402

ALL = [*cases.CASES, "concurrent-swaps"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs of every case (3)")
    p.add_argument("--cases", default=",".join(ALL), help=f"comma-separated cases (default all: {', '.join(ALL)})")
    p.add_argument(
        "--work",
        default=None,
        help="folder for the jobs' swap spaces and checkpoints (a temporary "
        "folder in the repository's swap/ by default: O_DIRECT needs a disk)",
    )
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "bench", "results", "faults", "micro"),
        help="folder for rows.jsonl (bench/results/faults/micro)",
    )
    args = p.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(ALL)}")
    os.makedirs(os.path.join(ROOT, "swap"), exist_ok=True)
    work = args.work or tempfile.mkdtemp(prefix="faults-", dir=os.path.join(ROOT, "swap"))
    os.makedirs(args.out, exist_ok=True)
    machine = machine_info(work)
    sha, dirty = git_state(ROOT)
    print(summary(machine), file=sys.stderr)

    ref_dir = os.path.join(work, "reference")
    os.makedirs(ref_dir)
    ref = cases.reference(ref_dir).finish()
    if ref.rc != 0 or not ref.losses():
        sys.exit(f"the uninterrupted reference run failed (exit {ref.rc}):\n{ref.log[-3000:]}")
    ref_losses = ref.losses()
    print(f"reference: {len(ref_losses)} losses in {ref.seconds:.0f}s", file=sys.stderr)

    with open(os.path.join(args.out, "rows.jsonl"), "a") as out:
        for run in range(args.runs):
            for name in names:
                folder = os.path.join(work, f"{name}-{run}")
                os.makedirs(folder)
                if name == "concurrent-swaps":
                    row = cases.concurrent_swaps(folder, seed=run)
                else:
                    row = cases.run_case(name, folder, ref_losses, seed=run)
                row.update(
                    run=run,
                    git_sha=sha,
                    git_dirty=dirty,
                    time=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    machine=machine,
                    steps=cases.STEPS,
                    save_every=cases.SAVE_EVERY,
                    fault_step=cases.FAULT_STEP + 1,
                    model="micro",
                )
                out.write(json.dumps(row) + "\n")
                out.flush()
                shutil.rmtree(folder, ignore_errors=True)
                print(
                    f"run {run} {name:<17} hang={row['hang']} crash={row['crash']} clear={row['clear_error']} "
                    f"data_lost={row['data_lost']} {row.get('seconds', '')}s",
                    file=sys.stderr,
                )
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
