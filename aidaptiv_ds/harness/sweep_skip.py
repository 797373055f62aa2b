"""Which cells of a sweep need not run: a measured out-of-memory of a cell that dominates this one under the
same caps (:func:`dominating_oom`), or the planner's prediction that the cell cannot fit (:func:`predicted_cell_oom`).
Both are recorded in the cell's row as inferred, with the reason."""

from __future__ import annotations

import os
from typing import Optional

from aidaptiv_ds.harness import eqmem
from aidaptiv_ds.harness.grid import Cell
from aidaptiv_ds.harness.sweep_cell import _aidaptiv_budget


def dominating_oom(cell: Cell, rows: list[dict], ctx: dict) -> Optional[str]:
    """Why ``cell`` need not run: a measured (not inferred) oom, under the same caps, of a smaller cell or of
    this cell in an earlier repeat (``rows`` are the runs done before it). None when there is none."""
    for r in rows:
        if r["status"] != "oom" or r.get("inferred"):
            continue
        if (
            r.get("gpu_mem_cap_gb") != ctx["gpu_mem_cap_gb"]
            or (r.get("host_mem_cap") or {}).get("gb") != ctx["cap"]["gb"]
        ):
            continue
        other = Cell(r["model"], r["backend"], r["gpus"], r["micro_batch"], r["seq_len"], r["grad_accum"])
        if other == cell:
            return f"this cell ran out of memory in repeat {r.get('repeat', 0)}"
        if other.dominates(cell):
            return f"smaller cell {other.id} ran out of memory"
    return None


def predicted_cell_oom(cell: Cell, ctx: dict) -> Optional[str]:
    """The planner's reason why ``cell`` will not fit under the sweep's caps, or None. The plan uses the
    host cap (else this machine's RAM), the GPU cap (else the GPU's memory, or none on CPU), the
    backend config's dtype and the framework and launcher memory measured by an earlier 'aidaptiv-ds plan' (cached;
    nothing is probed here, and an unknown figure counts as 0, so a cell is never predicted OOM for it)."""
    from aidaptiv_ds.config import ds_config
    from aidaptiv_ds.planner.guard import config_activations, predicted_oom
    from aidaptiv_ds.planner.rates import machine_rates

    if cell.backend == eqmem.BACKEND:
        return None  # the planner sizes the shipped configs; this one is sized per cell
    try:
        cfg = ds_config.load(os.path.join(ctx["spec"].ds_configs, f"{cell.backend}.json"))
    except ds_config.ConfigError:
        return None
    dtype = ds_config.dtype_name(cfg)
    if "framework" not in ctx:
        cached = machine_rates(dtype, None, probe=False)
        ctx["framework"] = int(cached.framework_host or 0)
        ctx["launcher"] = int(cached.launcher_host or 0)  # every cell runs under the deepspeed launcher
    host = int(ctx["cap"]["gb"] * 2**30) if ctx["cap"]["gb"] else int(ctx["machine"].get("ram_gb", 0) * 2**30)
    gpu = None
    if ctx["spec"].accelerator == "cuda":
        gpu = int(ctx["gpu_mem_cap_gb"] * 2**30) if ctx["gpu_mem_cap_gb"] else ctx.get("gpu_mem_bytes")
    nodes = ctx["spec"].nodes_for(cell)
    activations, chunk = config_activations(cfg)
    return predicted_oom(
        cell.model,
        cell.backend,
        gpus=cell.gpus // nodes,
        nodes=nodes,
        micro_batch=cell.micro_batch,
        seq_len=cell.seq_len,
        grad_accum=cell.grad_accum,
        dtype=dtype,
        host_mem=host,
        gpu_mem=gpu,
        host_budget=_aidaptiv_budget(cell, ctx),
        framework_host=ctx["framework"],
        launcher_host=ctx["launcher"],
        activations=activations,
        loss_chunk_tokens=chunk,
    )
