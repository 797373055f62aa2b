"""One cell of a sweep: its folder and config paths, the command that runs it, and the result row built
from what the run wrote (``build_row``)."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import sys
import uuid
from typing import Optional

from aidaptiv_ds.harness import eqmem
from aidaptiv_ds.harness.cellrun import CellRun, run_cell
from aidaptiv_ds.harness.grid import (
    Cell,
    Run,
)
from aidaptiv_ds.harness.launch import free_port, launch_command
from aidaptiv_ds.harness.outcome import Outcome, classify
from aidaptiv_ds.harness.results import (
    RESULTS_FILE,
    Row,
    append_row,
    write_row_file,
)
from aidaptiv_ds.models.presets import nominal_parameters


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _timed_steps(steps_list: Optional[list], steps: int, warmup: int) -> list[float]:
    """The timed step times: step_s lists every step (warm-up first) or only the timed ones."""
    if not steps_list:
        return []
    vals = [float(x) for x in steps_list if isinstance(x, (int, float))]
    return vals[warmup:] if len(vals) == steps and warmup < len(vals) else vals


def _num(x) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def build_row(
    cell: Cell,
    *,
    ctx: dict,
    outcome: Outcome,
    run: Optional[CellRun],
    command: Optional[str],
    time_start: str,
    time_end: str,
    cell_dir: Optional[str],
    inferred: bool = False,
    cap_used: Optional[dict] = None,
    repeat: int = 0,
) -> dict:
    """One row from a cell's outcome and its metrics (see results.Row for the fields). ``cap_used``:
    the host cap as applied to this cell (mechanism, detail), default the sweep's; ``repeat``: which run of
    the cell this is."""
    m = (run.metrics if run else None) or {}
    # Refused by train's launch guard: the plan's verdict, nothing measured (like a predicted-OOM skip).
    inferred = inferred or outcome.predicted
    timed = _timed_steps(m.get("step_s"), ctx["steps"], ctx["warmup"])
    step_med = _num(m.get("step_s_median")) or (statistics.median(timed) if timed else None)
    tps = _num(m.get("tokens_per_s"))
    if tps is None and step_med and outcome.status == "ok":
        world = m.get("world_size") or cell.gpus
        tps = cell.micro_batch * cell.seq_len * cell.grad_accum * world / step_med
    total_timed = sum(timed) if timed else None
    rd, wr = m.get("nvme_read_bytes"), m.get("nvme_write_bytes")
    params = m.get("params") if isinstance(m.get("params"), int) else None
    nominal = nominal_parameters(cell.model)
    cap = dict(ctx["cap"], **(cap_used or {}))
    row = {
        "row_id": uuid.uuid4().hex,
        "key": cell.id,
        "repeat": repeat,
        "grid": ctx["grid"],
        "aidaptiv_host_budget_bytes": _aidaptiv_budget(cell, ctx),
        "eqmem": _eqmem_sizing(cell, ctx).as_row() if cell.backend == eqmem.BACKEND else None,
        "git_sha": ctx["git_sha"],
        "git_dirty": ctx["git_dirty"],
        "time_start": time_start,
        "time_end": time_end,
        "wall_s": round(run.wall_s, 3) if run else 0.0,
        "machine": ctx["machine"],
        "backend": cell.backend,
        "model": cell.model,
        "params": params if params is not None else nominal,
        "params_source": "metrics" if params is not None else ("nominal" if nominal else None),
        "micro_batch": cell.micro_batch,
        "seq_len": cell.seq_len,
        "gpus": cell.gpus,
        "nodes": ctx["spec"].nodes_for(cell),
        "grad_accum": cell.grad_accum,
        "steps": ctx["steps"],
        "warmup": ctx["warmup"],
        "lr": ctx["lr"],
        "world_size": m.get("world_size") if isinstance(m.get("world_size"), int) else None,
        "status": outcome.status,
        "error": outcome.error,
        "inferred": inferred,
        "exit_code": run.returncode if run else None,
        "signal": outcome.signal,
        "tokens_per_s": tps,
        "step_s": step_med,
        "step_times_s": [float(x) for x in m["step_s"]] if isinstance(m.get("step_s"), list) else None,
        "losses": m.get("losses") if isinstance(m.get("losses"), list) else None,
        "phases_s": m.get("phases_s") if isinstance(m.get("phases_s"), dict) else None,
        "peak_gpu_mb": _num(m.get("peak_gpu_mb")),
        "peak_rss_mb": _num(m.get("peak_rss_mb")),
        "peak_pinned_mb": _num(m.get("peak_pinned_mb")),
        "tree_peak_rss_mb": round(run.tree_peak_rss_bytes / 2**20, 1) if run and run.tree_peak_rss_bytes else None,
        "cell_mem_peak_mb": round(run.cgroup_peak_bytes / 2**20, 1) if run and run.cgroup_peak_bytes else None,
        "nvme_read_bytes": rd if isinstance(rd, int) else None,
        "nvme_write_bytes": wr if isinstance(wr, int) else None,
        "nvme_read_gbps": rd / total_timed / 1e9 if isinstance(rd, int) and total_timed else None,
        "nvme_write_gbps": wr / total_timed / 1e9 if isinstance(wr, int) and total_timed else None,
        "gpu_mem_cap_gb": ctx["gpu_mem_cap_gb"],
        "host_mem_cap": {
            "gb": cap["gb"],
            "mechanism": cap["mechanism"],
            "detail": cap["detail"],
            "oom_kills": run.oom_kills if run else None,
        },
        "timeout_s": ctx["timeout_s"],
        "command": command,
        "cell_dir": os.path.relpath(cell_dir, ctx["out"]) if cell_dir else None,
    }
    return Row.model_validate(row).model_dump()


def _record(ctx: dict, row: dict, cell_dir: str) -> None:
    os.makedirs(cell_dir, exist_ok=True)
    write_row_file(os.path.join(cell_dir, "row.json"), row)  # first, so a crash before the append loses nothing
    append_row(os.path.join(ctx["out"], RESULTS_FILE), row)


def _cell_paths(run: Run, ctx: dict) -> tuple[str, str, str]:
    """(run folder, swap folder, metrics file) of a run of a cell."""
    cell_dir = os.path.join(ctx["out"], "cells", run.id)
    swap_dir = (
        os.path.join(ctx["swap_root"], f"{run.id}.{os.getpid()}")
        if ctx["swap_root"]
        else os.path.join(cell_dir, "swap")
    )
    return cell_dir, swap_dir, os.path.join(cell_dir, "metrics.json")


def _eqmem_config_path(run: Run, ctx: dict) -> str:
    return os.path.join(_cell_paths(run, ctx)[0], "ds_config.json")


def _command(run: Run, ctx: dict, port: int) -> list[str]:
    _, swap_dir, metrics_path = _cell_paths(run, ctx)
    cell = run.cell
    return launch_command(
        cell,
        ctx["spec"],
        port=port,
        swap_dir=swap_dir,
        metrics_out=metrics_path,
        steps=ctx["steps"],
        warmup=ctx["warmup"],
        gpu_mem_cap_gb=ctx["gpu_mem_cap_gb"],
        host_budget_bytes=_aidaptiv_budget(cell, ctx),
        config=_eqmem_config_path(run, ctx) if cell.backend == eqmem.BACKEND else None,
    )


def _aidaptiv_budget(cell: Cell, ctx: dict) -> Optional[int]:
    return ctx["grid_obj"].aidaptiv_budget_bytes(cell.model, cell.gpus) if cell.backend == "aidaptiv" else None


def _eqmem_base(ctx: dict) -> dict:
    """ds_configs/zero_infinity.json, read once per sweep."""
    if "eqmem_base" not in ctx:
        from aidaptiv_ds.config import ds_config

        ctx["eqmem_base"] = ds_config.load(os.path.join(ctx["spec"].ds_configs, f"{eqmem.BASE}.json"))
    return ctx["eqmem_base"]


def _eqmem_sizing(cell: Cell, ctx: dict) -> eqmem.EqmemSizing:
    """The zero_infinity_eqmem sizing of a cell: aidaptiv's budget for the same model and GPU count."""
    budget = ctx["grid_obj"].aidaptiv_budget_bytes(cell.model, cell.gpus)
    if budget is None:  # the grid's validation and run() refuse this before any cell runs
        raise ValueError(f"{cell.id}: no aidaptiv budget to size {eqmem.BACKEND} to (aidaptiv_state_fraction)")
    return eqmem.size_eqmem(_eqmem_base(ctx), cell.model, cell.gpus, budget)


def _fmt_row(row: dict) -> str:
    if row["status"] == "ok":
        tps = row["tokens_per_s"]
        what = f"ok {tps:,.1f} tokens/s" if tps is not None else "ok"
    else:
        what = f"{row['status']}{' (inferred)' if row['inferred'] else ''}: {row['error']}"
    rep = f" (repeat {row['repeat']})" if row["repeat"] else ""
    return f"{row['key']}{rep}: {what} [{row['wall_s']:.1f} s]"


def run_one(run_: Run, ctx: dict, tick) -> dict:
    """Run one cell in its own folder and swap space, under the sweep's host cap, and record its row."""
    cell = run_.cell
    cell_dir, swap_dir, metrics_path = _cell_paths(run_, ctx)
    shutil.rmtree(cell_dir, ignore_errors=True)  # a rerun must never read an old metrics.json
    os.makedirs(cell_dir)
    if cell.backend == eqmem.BACKEND:
        with open(_eqmem_config_path(run_, ctx), "w") as f:
            json.dump(eqmem.eqmem_config(_eqmem_base(ctx), _eqmem_sizing(cell, ctx)), f, indent=1)
            f.write("\n")
    shutil.rmtree(swap_dir, ignore_errors=True)
    os.makedirs(swap_dir, mode=0o700)
    os.chmod(swap_dir, 0o700)  # model state is private (DESIGN.md); makedirs' mode is masked by umask
    cmd = _command(run_, ctx, free_port())
    cap = ctx["cap"]
    cap_bytes = int(cap["gb"] * 2**30) if cap["gb"] else None
    cgroup, watchdog, cap_used = None, False, {}
    if cap_bytes and cap["factory"] is not None:
        try:
            cgroup = cap["factory"].create(f"aidaptiv-ds-{os.getpid()}-{uuid.uuid4().hex[:8]}", cap_bytes)
            cap_used = {"detail": cgroup.path}
        except OSError as e:  # fall back for this cell only, and say so in its row
            cap_used = {"mechanism": "rss-watchdog", "detail": f"cgroup creation failed: {e}"}
            watchdog = True
    elif cap_bytes:
        watchdog = True
    time_start = _now()
    try:
        run = run_cell(
            cmd,
            cell_dir=cell_dir,
            metrics_path=metrics_path,
            timeout_s=ctx["timeout_s"],
            env=ctx["env"],
            cwd=ctx["cwd"],
            cap_bytes=cap_bytes,
            cgroup=cgroup,
            watchdog=watchdog,
            tick=tick,
        )
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True)
        if os.path.exists(swap_dir):
            print(f"warning: could not remove swap folder {swap_dir}: delete it by hand", file=sys.stderr)
    outcome = classify(
        returncode=run.returncode,
        timed_out=run.timed_out,
        timeout_s=ctx["timeout_s"],
        cap_kill=run.cap_kill,
        output_tail=run.output_tail,
        metrics=run.metrics,
        metrics_problem=run.metrics_problem,
    )
    row = build_row(
        cell,
        ctx=ctx,
        outcome=outcome,
        run=run,
        command=shlex.join(cmd),
        time_start=time_start,
        time_end=_now(),
        cell_dir=cell_dir,
        cap_used=cap_used,
        repeat=run_.repeat,
    )
    _record(ctx, row, cell_dir)
    return row
