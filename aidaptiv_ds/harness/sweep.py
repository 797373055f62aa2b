"""Run a grid of training cells (model x micro-batch x sequence x GPU count x backend) against the baselines.

Each cell runs as its own process tree through the deepspeed launcher, so an out-of-memory, a crash or a
hang costs one cell, never the sweep: it is recorded and the next cell starts. One JSON row per cell is
appended to OUT/results.jsonl (and fsync'ed) as soon as the cell ends; logs stay in OUT/cells/<cell-id>/;
the cell's swap folder is deleted after it. `aidaptiv-ds report OUT` turns the rows into tables and plots.

Statuses: ok, oom (CUDA OOM, MemoryError, train's exit code 3, or killed by the host memory cap),
error (the error's last line is recorded), timeout (the tree is killed after the cell's time limit).

Host memory cap (--host-mem-cap-gb H): the cell's whole process tree (launcher and all ranks) gets H GiB.
It is enforced with a cgroup when /sys/fs/cgroup lets us create one (as root): cgroup v2 memory.max with
memory.swap.max 0, or cgroup v1 memory.limit_in_bytes + memory.memsw.limit_in_bytes; otherwise by an RSS
watchdog that sums the tree's RSS every 0.1 s and kills it when over. A cell killed by the cap is
status oom. Each row says which mechanism was used (host_mem_cap.mechanism).

Cells run in an order that gives every backend results early (backends interleaved, cheap shapes first);
with --skip-dominated (default) a cell is not run when a smaller cell of the same model, backend and GPU
count already ran out of memory: its row says status oom, "inferred": true. With repeats (the grid's
"repeats", or --repeats) the whole ordered list runs once, then again: every run is its own row with its
repeat index, logs in OUT/cells/<cell-id>__r<k>/ (repeat 0 keeps OUT/cells/<cell-id>/), and a repeat of a
cell that ran out of memory in an earlier repeat is inferred oom too.

Backend zero_infinity_eqmem (harness/eqmem.py) is ZeRO-Infinity with aidaptiv's host memory: before such a
cell starts, ds_configs/zero_infinity.json is copied to OUT/cells/<run>/ds_config.json with max_in_cpu, the
swap buffers and sub_group_size sized so that DeepSpeed's host memory for the model state is the aidaptiv
cell's host budget, and the sizing is recorded in the row ("eqmem"). Cells the planner says will
not fit under the caps are reported as "predicted OOM" beside their outcome; with --skip-predicted-oom they
are not run (status oom, "inferred": true, the plan's reason as the error).

On a SLURM cluster: --count-cells gives the size of a job array, --cell-index runs one cell; rows from
concurrent tasks are appended under a lock (see bench/README.md and bench/slurm/).
"""

from __future__ import annotations

__all__ = ["SweepOptions", "run_sweep", "default_ds_configs"]

import json
import os
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass, fields
from typing import Optional

from aidaptiv_ds.engine.machine import gpus as detect_gpus
from aidaptiv_ds.harness import eqmem
from aidaptiv_ds.harness.grid import (
    SWEEP_BACKENDS,
)
from aidaptiv_ds.harness.hostcap import host_cap
from aidaptiv_ds.harness.launch import LaunchSpec, train_spec
from aidaptiv_ds.harness.machine import machine_info
from aidaptiv_ds.harness.outcome import Outcome
from aidaptiv_ds.harness.prebuild import put_build_tools_first
from aidaptiv_ds.harness.results import (
    RESULTS_FILE,
    git_state,
    load_rows,
)
from aidaptiv_ds.harness.sweep_cell import (
    _command,
    _eqmem_sizing,
    _fmt_row,
    _now,
    _record,
    build_row,
    run_one,
)
from aidaptiv_ds.harness.sweep_skip import dominating_oom, predicted_cell_oom


class _Interrupted(Exception):
    pass


def default_ds_configs() -> str:
    """``./ds_configs`` when the current folder has one, else the shipped configs of the checkout this package
    runs from (an editable install, as scripts/setup.sh makes), so a sweep started elsewhere finds them."""
    here = os.path.abspath("ds_configs")
    if os.path.isdir(here):
        return here
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ds_configs")
    return checkout if os.path.isdir(checkout) else here


def _default_deepspeed() -> Optional[str]:
    near = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return near if os.access(near, os.X_OK) else shutil.which("deepspeed")


def _grid_configs(src: str, dst: str, names, *, dtype: Optional[str], aidaptiv_activations: Optional[dict]) -> str:
    """Copies of src/<name>.json in ``dst`` with what the grid sets: its precision (as train's --dtype does) on
    every config, its activations block on aidaptiv's, so that the cells, the planner's predictions and the
    ZeRO-Infinity eqmem sizing all read the same files; returns ``dst``. Rewritten on every run of the sweep
    (a resumed sweep gets the same files)."""
    from aidaptiv_ds.config import ds_config

    os.makedirs(dst, exist_ok=True)
    for name in sorted(names):
        cfg = ds_config.apply_overrides(ds_config.load(os.path.join(src, f"{name}.json")), dtype=dtype)
        if aidaptiv_activations is not None and isinstance(cfg.get("aidaptiv"), dict):
            cfg["aidaptiv"]["activations"] = dict(aidaptiv_activations)
        with open(os.path.join(dst, f"{name}.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    return dst


@dataclass
class SweepOptions:
    """How ``aidaptiv-ds sweep`` runs the cells it chose (its flags of the same names; None: the grid's)."""

    out: str
    steps: Optional[int] = None
    warmup: Optional[int] = None
    timeout_s: Optional[float] = None
    gpu_mem_cap_gb: Optional[float] = None
    host_mem_cap_gb: Optional[float] = None
    host_mem_cap_mechanism: str = "auto"
    train_module: Optional[str] = None
    deepspeed: Optional[str] = None
    ds_configs: Optional[str] = None
    accelerator: str = "auto"
    hostfile: Optional[str] = None
    gpus_per_node: Optional[int] = None
    master_addr: Optional[str] = None
    ds_launcher: Optional[str] = None
    swap_root: Optional[str] = None
    resume: bool = False
    dry_run: bool = False
    skip_dominated: bool = True
    skip_predicted_oom: bool = False
    prebuild: bool = False
    no_progress: bool = False

    @classmethod
    def from_namespace(cls, ns) -> "SweepOptions":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def run_sweep(grid, cells: list, runs: list, args: SweepOptions) -> int:
    """Run ``runs`` (the chosen cells and repeats of ``grid``): one row each in ``args.out``; returns the exit
    status (0, 1 when cells needed more GPUs than are usable here, 2 for bad options, 130 when interrupted)."""
    steps = args.steps if args.steps is not None else grid.steps
    warmup = args.warmup if args.warmup is not None else grid.warmup
    problems = []
    if steps <= 0 or warmup < 0 or warmup >= steps:
        problems.append(f"--steps {steps} / --warmup {warmup}: need 0 <= warmup < steps")
    spec_train = train_spec(args.train_module)
    ds_bin = args.deepspeed or _default_deepspeed()
    if not ds_bin or not (os.access(ds_bin, os.X_OK) or shutil.which(ds_bin)):
        problems.append(f"deepspeed launcher {ds_bin or 'deepspeed'} not found: install deepspeed or pass --deepspeed")
    ds_configs = os.path.abspath(args.ds_configs or default_ds_configs())
    for b in sorted({r.cell.backend for r in runs}, key=SWEEP_BACKENDS.index):
        name = eqmem.BASE if b == eqmem.BACKEND else b  # eqmem's config is derived from zero_infinity.json
        if not os.path.isfile(os.path.join(ds_configs, f"{name}.json")):
            problems.append(f"backend {b}: {os.path.join(ds_configs, name + '.json')} not found (--ds-configs)")
    unsized = sorted(
        {
            r.cell.model
            for r in runs
            if r.cell.backend == eqmem.BACKEND and grid.aidaptiv_budget_bytes(r.cell.model, r.cell.gpus) is None
        }
    )
    if unsized:
        problems.append(
            f"backend {eqmem.BACKEND} is sized to aidaptiv's host budget, but the grid gives models "
            f"{unsized} none: set aidaptiv_state_fraction in the grid"
        )
    if args.hostfile and not os.path.isfile(args.hostfile):
        problems.append(f"--hostfile {args.hostfile} not found")
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2

    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "cells"), exist_ok=True)
    if grid.dtype or grid.aidaptiv_activations is not None:
        ds_configs = _grid_configs(
            ds_configs,
            os.path.join(out, "ds_configs"),
            {eqmem.BASE if r.cell.backend == eqmem.BACKEND else r.cell.backend for r in runs},
            dtype=grid.dtype,
            aidaptiv_activations=(
                grid.aidaptiv_activations.model_dump(exclude_unset=True)
                if grid.aidaptiv_activations is not None
                else None
            ),
        )
    loaded = load_rows(out)
    for p in loaded.problems:
        print(f"warning: {p}", file=sys.stderr)

    gpu_cap = args.gpu_mem_cap_gb if args.gpu_mem_cap_gb is not None else grid.gpu_mem_cap_gb
    host_cap_gb = args.host_mem_cap_gb if args.host_mem_cap_gb is not None else grid.host_mem_cap_gb
    cap = host_cap(host_cap_gb, args.host_mem_cap_mechanism)
    if isinstance(cap, str):
        print(f"error: {cap}", file=sys.stderr)
        return 2

    gpu_list = detect_gpus()
    accel = args.accelerator if args.accelerator != "auto" else ("cuda" if gpu_list else "cpu")
    spec = LaunchSpec(
        accelerator=accel,
        deepspeed=ds_bin,
        train=spec_train,
        ds_configs=ds_configs,
        hostfile=os.path.abspath(args.hostfile) if args.hostfile else None,
        gpus_per_node=args.gpus_per_node,
        master_addr=args.master_addr,
        ds_launcher=args.ds_launcher,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES") if accel == "cuda" else None,
    )
    swap_root = os.path.abspath(args.swap_root) if args.swap_root else None
    if swap_root:
        os.makedirs(swap_root, exist_ok=True)
    sha, dirty = git_state()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    put_build_tools_first(env)
    ctx = {
        "out": out,
        "grid": grid.name,
        "grid_obj": grid,
        "git_sha": sha,
        "git_dirty": dirty,
        "steps": steps,
        "warmup": warmup,
        "lr": grid.lr,
        "timeout_s": args.timeout_s if args.timeout_s is not None else grid.timeout_s,
        "gpu_mem_cap_gb": gpu_cap,
        "cap": cap,
        "spec": spec,
        "swap_root": swap_root,
        "env": env,
        "cwd": os.getcwd(),
        "machine": machine_info(swap_root or os.path.join(out, "cells")),
        "gpu_mem_bytes": (
            int(min(g["memory_mb"] for g in gpu_list) * 2**20)
            if gpu_list and all(g["memory_mb"] for g in gpu_list)
            else None
        ),
    }
    # GPUs this process may use: CUDA_VISIBLE_DEVICES (as SLURM sets it) when given, else all nvidia-smi lists.
    usable_gpus = (
        len([d for d in spec.visible_devices.split(",") if d.strip()]) if spec.visible_devices else len(gpu_list)
    )
    bad_split = []
    for r in runs:
        try:
            _command(r, ctx, port=0)
        except ValueError as e:
            if spec.hostfile:  # a cell that cannot be spread over the nodes: the grid and the allocation disagree
                bad_split.append(str(e))
    if bad_split:
        for e in bad_split[:10]:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if accel == "cuda" and not spec.hostfile and gpu_cap and gpu_list:
        smallest = min(g["memory_mb"] or 0 for g in gpu_list) / 1024
        if smallest and gpu_cap > smallest:
            print(
                f"warning: --gpu-mem-cap-gb {gpu_cap:g} exceeds this GPU's {smallest:.0f} GiB: the cap changes nothing",
                file=sys.stderr,
            )

    done = {(r["key"], r["repeat"]) for r in loaded.rows}
    # Rows that can make a cell dominated: this run's, and with --resume the kept ones (without it, an OOM
    # recorded by an older build must not stop a newer one from trying).
    rows = list(loaded.rows) if args.resume else []
    if args.resume:
        keys = {c.id for c in cells}
        changed = [
            r["key"]
            for r in loaded.latest_by_key().values()
            if r["key"] in keys
            and (r["steps"], r["warmup"], r["gpu_mem_cap_gb"], r["host_mem_cap"]["gb"])
            != (steps, warmup, gpu_cap, host_cap_gb)
        ]
        if changed:
            print(
                f"warning: --resume keeps {len(changed)} earlier row(s) run under other steps/warm-up/caps, "
                f"e.g. {changed[0]}",
                file=sys.stderr,
            )

    if args.dry_run:
        for r in runs:
            if not (args.resume and (r.cell.id, r.repeat) in done):
                print(shlex.join(_command(r, ctx, port=29500)))
        return 0

    over = {}
    for c in {r.cell for r in runs if r.cell.backend == eqmem.BACKEND}:
        sizing = _eqmem_sizing(c, ctx)
        if sizing.over_budget_bytes:
            over[c.id] = sizing
    for cid, sizing in sorted(over.items()):
        print(
            f"note: {cid}: ZeRO-Infinity's smallest host memory for the state, {sizing.sized_bytes / 2**20:.0f} "
            f"MiB, exceeds aidaptiv's budget of {sizing.budget_bytes / 2**20:.0f} MiB; it runs with that "
            "minimum and max_in_cpu 0 (see harness/eqmem.py)",
            file=sys.stderr,
        )

    # Cells run under host-memory caps: RAM that earlier DeepSpeed CPU runs left in /dev/shm is RAM the
    # cells do not have.
    from aidaptiv_ds import remove_leaked_shared_memory

    removed = remove_leaked_shared_memory()
    if removed:
        print(removed, file=sys.stderr)

    if args.prebuild:
        from aidaptiv_ds.harness.prebuild import prebuild

        for line in prebuild({r.cell.backend for r in runs}, env):
            print(f"DeepSpeed op {line}", file=sys.stderr)

    from tqdm import tqdm

    counts: dict[str, int] = {}
    unrunnable = []
    pbar = tqdm(total=len(runs), unit="run", file=sys.stderr, dynamic_ncols=True, disable=args.no_progress)
    last = "-"

    def on_term(signum, frame):
        raise _Interrupted(signum)

    old_term = signal.signal(signal.SIGTERM, on_term)
    current = None
    try:
        for run_ in runs:
            cell = current = run_.cell
            if args.resume and (cell.id, run_.repeat) in done:
                counts["skipped (resume)"] = counts.get("skipped (resume)", 0) + 1
                pbar.update(1)
                continue
            if accel == "cuda" and not spec.hostfile and cell.gpus > usable_gpus:
                unrunnable.append(cell.id)
                pbar.write(f"{cell.id}: not run, needs {cell.gpus} GPUs and {usable_gpus} are usable here")
                pbar.update(1)
                continue
            pbar.set_description(run_.id)
            dom = dominating_oom(cell, rows, ctx) if args.skip_dominated else None
            predicted = predicted_cell_oom(cell, ctx)
            if predicted:
                counts["predicted OOM"] = counts.get("predicted OOM", 0) + 1
            if not dom and predicted and args.skip_predicted_oom:
                t = _now()
                row = build_row(
                    cell,
                    ctx=ctx,
                    inferred=True,
                    run=None,
                    command=None,
                    time_start=t,
                    time_end=t,
                    outcome=Outcome("oom", f"skipped: predicted OOM: {predicted}"),
                    cell_dir=os.path.join(out, "cells", run_.id),
                    repeat=run_.repeat,
                )
                _record(ctx, row, os.path.join(out, "cells", run_.id))
            elif dom:
                t = _now()
                row = build_row(
                    cell,
                    ctx=ctx,
                    inferred=True,
                    run=None,
                    command=None,
                    time_start=t,
                    time_end=t,
                    outcome=Outcome("oom", f"skipped: {dom}"),
                    cell_dir=os.path.join(out, "cells", run_.id),
                    repeat=run_.repeat,
                )
                _record(ctx, row, os.path.join(out, "cells", run_.id))
            else:
                shown = [-1]

                def tick(elapsed):
                    if int(elapsed) != shown[0]:  # once a second
                        shown[0] = int(elapsed)
                        pbar.set_postfix_str(f"{elapsed:.0f} s, last: {last}", refresh=True)

                row = run_one(run_, ctx, tick)
            rows.append(row)
            last = row["status"] + ("*" if row["inferred"] else "")
            counts[last] = counts.get(last, 0) + 1
            pbar.write(_fmt_row(row) + (f" (predicted OOM: {predicted})" if predicted and not row["inferred"] else ""))
            pbar.set_postfix_str(f"last: {last}")
            pbar.update(1)
    except (KeyboardInterrupt, _Interrupted) as e:
        pbar.close()
        what = "SIGTERM" if isinstance(e, _Interrupted) else "Ctrl-C"
        print(
            f"interrupted by {what} during {current.id if current else '-'}: that run has no row; "
            f"run again with --resume to continue",
            file=sys.stderr,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, old_term)
    pbar.close()
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "nothing to do"
    print(f"sweep {grid.name}: {summary}; rows in {os.path.join(out, RESULTS_FILE)}", file=sys.stderr)
    if unrunnable:
        print(
            f"error: {len(unrunnable)} cell(s) need more GPUs than are usable here, e.g. {unrunnable[0]}",
            file=sys.stderr,
        )
        return 1
    return 0
