"""The launch guard: what the planner says a job needs, checked before the job writes a byte.

``zero.Init`` writes each layer's partitions to the swap space as soon as the layer is built, and the model
is unknown when the swap space is opened, so the free-space check of :func:`aidaptiv_ds.config.resolve.validate`
(``needed_bytes``) can only run once the model exists: too late for a model that does not fit (a 70B preset
wrote 51 GB of parameters before ENOSPC). ``aidaptiv-ds train`` knows the model's shape from the start and
calls :func:`launch_problems` before building anything.

Only what is certain is refused: swap bytes (the swap files' sizes, for all ranks of this node on their
disk), a host budget below the minimum the swapper needs, and host memory the model state or the pinned
pool alone would exceed (framework and activations not counted, so the check never refuses a job that fits).
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Dict, List, Optional, Tuple

from aidaptiv_ds.common.sizes import GiB
from aidaptiv_ds.config import ds_config as dsc
from aidaptiv_ds.planner.memory import Hardware, Job, plan_backend
from aidaptiv_ds.planner.shapes import ModelShape, resolve_shape

# The device side is not checked at launch (activations are approximate): a GPU "large enough for anything".
_UNCHECKED = 1 << 62


def _existing(path: str) -> str:
    """``path`` or its nearest existing ancestor (DeepSpeed creates its swap folder itself)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def launch_problems(
    shape: ModelShape,
    cfg: dict,
    *,
    world_size: int,
    local_world_size: int,
    seq_len: int,
    micro_batch: int,
    cuda: bool,
    ram_bytes: int,
    disk_free: Callable[[str], int] = lambda p: shutil.disk_usage(p).free,
    lora: bool = False,
) -> List[str]:
    """Problems that make the job impossible on this node, with the numbers (empty: nothing refused).
    ``cfg`` is the DeepSpeed config the job runs with; ``ram_bytes`` the memory the node's ranks may use;
    ``lora``: the base is frozen (adapters trained), so its parameters are all the state that is certain."""
    backend = dsc.backend(cfg)
    if backend not in ("zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv"):
        return []
    local = max(1, local_world_size)
    hw = Hardware(
        gpus=local, nodes=max(1, world_size // local), gpu_mem=_UNCHECKED if cuda else None, host_mem=ram_bytes
    )
    job = Job(shape, seq_len, micro_batch, dtype=dsc.dtype_name(cfg))
    problems: List[str] = []
    if backend == "aidaptiv":
        from aidaptiv_ds.config.schema import block_of
        from aidaptiv_ds.config.settings import SwapSettings

        block = block_of(cfg) or {}
        if not block.get("enabled") or not block.get("nvme_path"):
            return []  # the block's own validation reports these
        settings = SwapSettings.from_block(block, ram_bytes)
        job.host_budget = settings.host_budget_bytes
        job.layer_group_size = settings.layer_group_size
        job.prefetch_depth = settings.prefetch_depth
        job.chunk_numel = settings.optimizer_chunk_numel
        job.cache_optimizer_state = settings.cache_optimizer_state
        paths = [settings.nvme_path]
    else:
        paths = [b["nvme_path"] for b in dsc.nvme_blocks(cfg) if b.get("nvme_path")]
    if lora:
        return _frozen_base_problems(shape, backend, job.dtype, paths, world_size, local, ram_bytes, disk_free)
    plan = plan_backend(backend, job, hw)
    if plan.split is not None and not plan.split.fits:
        problems.append(plan.split.shortfall())
    if plan.nvme and paths:
        need = plan.nvme_bytes * local
        where = _existing(paths[0])
        free = disk_free(where)
        if need > free:
            parts = ", ".join(f"{k} {v * local / GiB:.1f} GiB" for k, v in plan.nvme.items())
            problems.append(
                f"swap space: {paths[0]} has {free / GiB:.1f} GiB free but {backend} needs {need / GiB:.1f} GiB for "
                f"{shape.name} ({shape.num_parameters / 1e9:.2f}B parameters, {job.dtype}, {local} rank(s) on this "
                f"node: {parts}): free space, choose a larger disk, or spread the model over more nodes"
            )
    # Host memory the model state and pinned buffers alone take (a lower bound: no framework, no activations).
    certain: Dict[str, int] = {
        k: v
        for k, v in {**plan.host_pinned, **plan.host_pageable}.items()
        if not k.startswith(("framework", "activations", "DeepSpeed buffers"))
    }
    host = sum(certain.values()) * local
    if host > ram_bytes:
        top = max(certain, key=certain.get)
        pinned = sum(plan.host_pinned.values()) * local
        problems.append(
            f"host memory: {backend} needs at least {host / GiB:.1f} GiB on this node ({pinned / GiB:.1f} GiB of it "
            f"pinned; largest: {top}, {certain[top] * local / GiB:.1f} GiB) but the ranks may use "
            f"{ram_bytes / GiB:.1f} GiB (RAM, or the cgroup's limit): use a backend that keeps less in memory, a "
            "smaller host budget, or more nodes"
        )
    return problems


def _frozen_base_problems(shape, backend, dtype, paths, world_size, local, ram_bytes, disk_free) -> List[str]:
    """A LoRA job's certain needs: the frozen base's own bytes (no gradient, master copy or moments; the
    adapters are a fraction of a percent), on the swap disk where the backend puts parameters there, else in
    host memory. The planner's memory model is full fine-tuning's, so nothing else is refused."""
    from aidaptiv_ds.common.sizes import dtype_bytes

    need = dtype_bytes(dtype) * -(-shape.num_parameters // max(1, world_size)) * local
    what = f"the frozen base of {shape.name} ({shape.num_parameters / 1e9:.2f}B parameters, {dtype}, {local} rank(s))"
    if paths:
        free = disk_free(_existing(paths[0]))
        if need > free:
            return [
                f"swap space: {paths[0]} has {free / GiB:.1f} GiB free but {backend} needs {need / GiB:.1f} GiB for "
                f"{what}: free space or choose a larger disk"
            ]
    elif need > ram_bytes:
        return [
            f"host memory: {backend} keeps {what} in memory, {need / GiB:.1f} GiB, but the ranks may use "
            f"{ram_bytes / GiB:.1f} GiB: use aidaptiv (the base streamed from NVMe) or a smaller model"
        ]
    return []


# aidaptiv.activations.policy -> the planner's activation mode. "auto" keeps what its activation budget holds
# and stores or recomputes the rest, so the least it can hold, nvme's, is what decides whether a job fits.
PLANNER_ACTIVATIONS = {"keep": "keep", "recompute": "recompute", "nvme": "nvme", "auto": "nvme"}


def config_activations(cfg: dict) -> Tuple[str, Optional[int]]:
    """(the planner's activation mode, loss chunk tokens or None) of a DeepSpeed config as `aidaptiv-ds train`
    runs it (the sweep's cells): an "aidaptiv" block's activations, a block naming no policy as the job runs it
    (policy auto, see job.run_config.auto_activations_by_default), the loss in chunks of 1024 tokens unless it says
    otherwise; "keep" and unchunked for any other config. A block that does not validate is taken as its
    defaults (train's own validation reports it)."""
    from aidaptiv_ds.config.schema import ActivationsConfig, block_of, is_enabled

    if not is_enabled(cfg):
        return "keep", None
    block = block_of(cfg)
    try:
        act = ActivationsConfig.model_validate(block.get("activations") or {})
    except ValueError:
        act = ActivationsConfig()
    named = isinstance(block.get("activations"), dict) and "policy" in block["activations"]
    return PLANNER_ACTIVATIONS[act.policy if named else "auto"], act.loss_chunk_tokens or None


def predicted_oom(
    model: str,
    backend: str,
    *,
    gpus: int,
    nodes: int,
    micro_batch: int,
    seq_len: int,
    grad_accum: int,
    dtype: str,
    host_mem: int,
    gpu_mem: Optional[int],
    host_budget: Optional[int],
    framework_host: int = 0,
    launcher_host: int = 0,
    activations: str = "keep",
    loss_chunk_tokens: Optional[int] = None,
) -> Optional[str]:
    """Why the plan says a sweep cell will run out of memory (its first problem), or None when it fits or
    the model is not one the planner can size. Unlike :func:`launch_problems`, the whole plan counts:
    framework, activations and DeepSpeed's buffers too (``activations`` and ``loss_chunk_tokens`` as
    :func:`config_activations` gives them for the cell's config)."""
    try:
        shape = resolve_shape(model)
    except ValueError:
        return None
    hw = Hardware(
        gpus=gpus,
        nodes=nodes,
        gpu_mem=gpu_mem,
        host_mem=host_mem,
        framework_host=framework_host,
        launcher_host=launcher_host,
    )
    job = Job(
        shape,
        seq_len,
        micro_batch,
        grad_accum,
        dtype=dtype,
        activations=activations,
        loss_chunk_tokens=loss_chunk_tokens,
        host_budget=host_budget,
    )
    plan = plan_backend(backend, job, hw)
    return plan.problems[0] if plan.problems else None
