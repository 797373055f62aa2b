"""One `aidaptiv-ds train` run of a benchmark: run it in its own process, keep its metrics, remove its swap.

Shared by the benchmark scripts beside this file (they run as `python bench/NAME.py`, so this folder is on
sys.path)."""

import json
import os
import shutil
import subprocess
import sys
import time


def run_train(cmd, cwd, env, swap, metrics, **row):
    """Run ``cmd`` and return ``row`` with its return code, wall time, command and the run's metrics JSON (or
    the last line of its output when it wrote none); ``swap`` is removed afterwards."""
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    row.update(returncode=proc.returncode, wall_s=time.time() - t0, command=cmd)
    if os.path.exists(metrics):
        with open(metrics) as f:
            row["metrics"] = json.load(f)
    else:
        row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    shutil.rmtree(swap, ignore_errors=True)
    return row


def paired_ratios(figures, num, den):
    """``num``'s figure over ``den``'s in each repeat where both have one. ``figures``: {(backend, repeat):
    value} of the runs that went ok. The runs of a repeat are neighbours in time, so the machine's drift
    cancels in the ratio."""
    reps = sorted({rep for (_, rep) in figures})
    return [
        figures[(num, rep)] / figures[(den, rep)]
        for rep in reps
        if (num, rep) in figures and (den, rep) in figures and figures[(den, rep)]
    ]


def eqmem_sizing(root, model, budget_bytes):
    """ZeRO-Infinity's shipped config and its host memory sized to aidaptiv's budget (one rank), as the sweep
    sizes its zero_infinity_eqmem cells (aidaptiv_ds/harness/eqmem.py)."""
    from aidaptiv_ds.config import ds_config
    from aidaptiv_ds.harness import eqmem

    base = ds_config.load(os.path.join(root, "ds_configs", f"{eqmem.BASE}.json"))
    return base, eqmem.size_eqmem(base, model, 1, budget_bytes)


def run_interleaved(names, repeats, run, rows_path, common, per_name=lambda name: {}):
    """Run each of ``names`` ``repeats`` times, interleaved, the order alternating per repeat (a slow spell of
    the machine falls on all alike). Each row, ``run(name)`` updated with ``common``, ``per_name(name)``, its
    repeat and time, is appended to ``rows_path`` as soon as it ends and echoed (its figures from its
    ``metrics``, or from the row itself when it has none); returns the rows."""
    rows = []
    with open(rows_path, "a") as out:
        for rep in range(repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                row = run(name)
                row.update(common, **per_name(name), repeat=rep, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
                out.write(json.dumps(row) + "\n")
                out.flush()
                rows.append(row)
                m = row.get("metrics") or row
                step, rss = (m.get(k) for k in ("step_s_median", "peak_rss_mb"))
                print(
                    f"repeat {rep} {name:22s} step {float('nan') if step is None else step:.3f} s "
                    f"rss {float('nan') if rss is None else rss:.0f} MiB {row.get('error', '')}",
                    file=sys.stderr,
                )
    return rows


def bench_setup(root, swap_root, out):
    """What every benchmark run starts with: its swap and output folders made, the child environment (the
    repository's JIT-op folder unless TORCH_EXTENSIONS_DIR says otherwise), the machine's facts and the
    commit. Returns (env, machine, sha, dirty).

    The environment's bin goes first on the children's PATH: the paths a benchmark alternates between start
    differently (a plain script with this Python, `aidaptiv-ds train`, which puts its bin first), and two
    ninjas sharing one extensions folder rebuild DeepSpeed's ops at every switch (harness/prebuild.py)."""
    from aidaptiv_ds.harness.machine import machine_info
    from aidaptiv_ds.harness.prebuild import put_build_tools_first
    from aidaptiv_ds.harness.results import git_state

    os.makedirs(swap_root, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(root, ".torch_extensions"))
    put_build_tools_first(env)
    sha, dirty = git_state(root)
    return env, machine_info(swap_root), sha, dirty


def add_run_arguments(parser, repeats: int, repeats_help: str) -> None:
    """The run shape every step-time benchmark takes: model, sequence, micro-batch, steps, warm-up, repeats
    and the aidaptiv host budget as a fraction of the model state."""
    parser.add_argument("--model", default="tiny", help="model preset (default tiny: 58M parameters)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (64)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per step (2)")
    parser.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included (12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (2)")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help}, interleaved ({repeats})")
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.25,
        help="aidaptiv host budget as a fraction of the model state (default %(default)s)",
    )
