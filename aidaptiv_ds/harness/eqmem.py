"""ZeRO-Infinity with aidaptiv's host memory: the ``zero_infinity_eqmem`` backend of the sweep.

The sweep gives an aidaptiv cell a host budget (``aidaptiv_state_fraction`` of the model state, per rank), and
that budget holds everything aidaptiv keeps in host RAM for the model state: layer-group slots, the resident
optimizer sub-groups, gradient buffers and staging. ``zero_infinity_eqmem`` is ``ds_configs/zero_infinity.json``
with the host-side memory DeepSpeed 0.19.8 allocates for the same state sized to that budget, written per cell
into the cell's folder. What DeepSpeed pins per rank (N: the rank's partition elements, e: bytes per element of
the training dtype, S: the largest optimizer sub-group in elements, A(n): n rounded up to DeepSpeed's I/O
alignment of 1024 x intra_op_parallelism bytes):

==================================  ==========================================================  ============
part                                DeepSpeed 0.19.8 source                                      bytes
==================================  ==========================================================  ============
gradient partitions                 stage3 ``grad_partitions_flat_buffer``                       N x grad dtype
parameter swap buffers              ``AsyncPartitionedParameterSwapper.buffers``                 count x A(buffer_size) x e
optimizer swap buffers              ``OptimizerSwapper.swap_buffer_manager`` (fp32)              count x A(S) x 4
optimizer-init gradient buffer      stage3 ``initialize_optimizer_states`` (kept as .grad)       S x 4
parameter write-back buffer         ``reserve_partitioned_swap_space`` (only when a sub-group    sum A(full numel) x e of
                                    lives on NVMe; sized with the parameters' *full* numels)     the largest sub-group
parameter RAM cache (max_in_cpu)    stage3 ``param_groups_fp16_flat_cpu_memory``                 min(max_in_cpu, N) x e
==================================  ==========================================================  ============

Only the last one caches: the leading sub-groups that fit whole into ``max_in_cpu`` elements stay in RAM for
good (DeepSpeed places sub-groups, never parts of one). The others are fixed by the model, or have a minimum
below which DeepSpeed cannot run: a parameter buffer holds the largest partition (``buffer_size`` = that),
``buffer_count`` stays the shipped 5 (fewer fails with "Not enough buffers") and the optimizer's 4 (Adam's
three states and the gradient), and a sub-group is never smaller than its largest parameter.

The rule: for each ``sub_group_size`` from the shipped file's, halved down to the largest partition, size the
fixed parts, and cache the leading sub-groups that fit into what is left of the budget; keep the size that
caches the most elements (on a tie the larger sub-groups: fewer, larger optimizer transfers). ``max_in_cpu`` is
then exactly the cached elements, so nothing pinned goes unused: the sized bytes are at most the budget and
short of it by less than the next sub-group's bytes. When even the smallest fixed parts exceed the budget
(small fractions: the gradient partitions alone are 4 bytes of the 20 per parameter), the cell runs with those
smallest parts and ``max_in_cpu`` 0, and its row says by how much ZeRO-Infinity is over aidaptiv's budget.

Not counted (the same for both, or too small to matter): parameters under 1 MiB or under
``stage3_param_persistence_threshold`` that DeepSpeed never swaps (norms: kilobytes), the reduce bucket and
activations (outside the budget for aidaptiv too), the framework itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

from aidaptiv_ds.common.sizes import dtype_bytes
from aidaptiv_ds.config import ds_config
from aidaptiv_ds.planner.memory import partition_numels
from aidaptiv_ds.planner.shapes import resolve_shape

BACKEND = "zero_infinity_eqmem"
BASE = "zero_infinity"
AIO_ALIGNED_BYTES = 1024  # deepspeed/runtime/swap_tensor/utils.py
OPTIMIZER_BUFFERS = 4  # Adam: weights, moments, gradient (PartitionedOptimizerSwapper's requirement)


@dataclass(frozen=True)
class EqmemSizing:
    """How one cell's ZeRO-Infinity host memory was sized against aidaptiv's budget (bytes per rank)."""

    budget_bytes: int
    sub_group_size: int
    max_in_cpu: int
    param_buffer_count: int
    param_buffer_size: int
    optimizer_buffer_count: int
    parts: dict = field(default_factory=dict)
    """Bytes per part (see the module docstring)."""
    cached_numel: int = 0
    """Partition elements DeepSpeed keeps in RAM (whole sub-groups inside max_in_cpu)."""
    partition_numel: int = 0
    """All partition elements of the rank."""
    next_sub_group_bytes: Optional[int] = None
    """Bytes of the first sub-group not cached (None when all are): the most the sizing can fall short by."""

    @property
    def sized_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def over_budget_bytes(self) -> int:
        return max(0, self.sized_bytes - self.budget_bytes)

    def as_row(self) -> dict:
        """The sizing as a result row records it."""
        return {
            "budget_bytes": self.budget_bytes,
            "sized_bytes": self.sized_bytes,
            "over_budget_bytes": self.over_budget_bytes,
            "parts": dict(self.parts),
            "sub_group_size": self.sub_group_size,
            "max_in_cpu": self.max_in_cpu,
            "param_buffer_count": self.param_buffer_count,
            "param_buffer_size": self.param_buffer_size,
            "optimizer_buffer_count": self.optimizer_buffer_count,
            "cached_numel": self.cached_numel,
            "partition_numel": self.partition_numel,
        }


def _aligned(numel: int, elsize: int, intra_op: int) -> int:
    """DeepSpeed's _io_aligned_numel: up to a multiple of (1024 x intra_op_parallelism) bytes."""
    align = AIO_ALIGNED_BYTES * intra_op // elsize
    return -(-numel // align) * align


def _grad_bytes(cfg: dict) -> int:
    """Bytes per gradient element of stage3's flat buffer: data_types.grad_accum_dtype, else the model dtype
    (engine.get_data_types)."""
    name = (cfg.get("data_types") or {}).get("grad_accum_dtype") or ds_config.dtype_name(cfg)
    return dtype_bytes(
        {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}.get(
            str(name).lower(), "fp32"
        )
    )


def _sub_group_ranges(part_numels: list[int], sub_group_size: int) -> list[tuple[int, int]]:
    """(first, end) parameter indices of DeepSpeed's sub-groups (stage3 _create_fp16_sub_groups, as
    planner.memory._sub_groups counts them)."""
    if sub_group_size >= sum(part_numels):
        return [(0, len(part_numels))]
    out, first, size = [], 0, 0
    for i, n in enumerate(part_numels):
        size += n
        if size >= sub_group_size or i == len(part_numels) - 1:
            out.append((first, i + 1))
            first, size = i + 1, 0
    return out


def size_eqmem(base_cfg: dict, model: str, world: int, budget_bytes: int) -> EqmemSizing:
    """The ZeRO-Infinity host sizing for ``model`` on ``world`` ranks under ``budget_bytes`` per rank (the rule
    in the module docstring). Pure arithmetic: no torch, no DeepSpeed."""
    shape = resolve_shape(model)
    e = dtype_bytes(ds_config.dtype_name(base_cfg))
    g = _grad_bytes(base_cfg)
    intra = int((base_cfg.get("aio") or {}).get("intra_op_parallelism", 1) or 1)
    zero = base_cfg.get("zero_optimization") or {}
    base_sgs = int(zero.get("sub_group_size", 1_000_000_000))
    p_count = int((zero.get("offload_param") or {}).get("buffer_count", 5))
    o_count = max(OPTIMIZER_BUFFERS, int((zero.get("offload_optimizer") or {}).get("buffer_count", 4)))
    parts_n = partition_numels(shape, world)
    full_n = shape.parameter_numels()
    total = sum(parts_n)
    largest = max(parts_n)

    candidates, sgs = [], base_sgs
    while sgs > largest:
        candidates.append(sgs)
        sgs //= 2
    candidates.append(largest)

    best = None
    for sgs in candidates:
        ranges = _sub_group_ranges(parts_n, sgs)
        subs = [sum(parts_n[a:b]) for a, b in ranges]
        s_max = max(subs)
        # stage3 picks the first sub-group with the most partition elements for the write-back buffer, and
        # sizes it with its parameters' full numels.
        lo, hi = ranges[subs.index(s_max)]
        write_back = sum(_aligned(n, e, intra) for n in full_n[lo:hi]) * e
        fixed = {
            "gradient partitions": total * g,
            "parameter swap buffers": p_count * _aligned(largest, e, intra) * e,
            "optimizer swap buffers": o_count * _aligned(s_max, 4, intra) * 4,
            "optimizer-init gradient buffer": s_max * 4,
        }
        room = budget_bytes - sum(fixed.values())
        cached, k = 0, 0
        if room >= 0:
            while k < len(subs):
                need = cached + subs[k]
                all_cached = k + 1 == len(subs)
                if need * e + (0 if all_cached else write_back) > room:
                    break
                cached, k = need, k + 1
        parts = dict(fixed)
        if k < len(subs):
            parts["parameter write-back buffer"] = write_back
        parts["parameter RAM cache (max_in_cpu)"] = cached * e
        sizing = EqmemSizing(
            budget_bytes=budget_bytes,
            sub_group_size=sgs,
            max_in_cpu=cached,
            param_buffer_count=p_count,
            param_buffer_size=largest,
            optimizer_buffer_count=o_count,
            parts=parts,
            cached_numel=cached,
            partition_numel=total,
            next_sub_group_bytes=subs[k] * e if k < len(subs) else None,
        )
        if best is None:
            best = sizing
            continue
        fits, best_fits = sizing.sized_bytes <= budget_bytes, best.sized_bytes <= budget_bytes
        if fits and (not best_fits or sizing.cached_numel > best.cached_numel):
            best = sizing
        elif not fits and not best_fits and sizing.sized_bytes < best.sized_bytes:
            best = sizing
    return best


def documented_config(base_cfg: dict, model: str, world: int = 1) -> dict:
    """``base_cfg`` (zero_infinity.json) for ``model`` as DeepSpeed documents it: the parameter swap buffers at
    least the largest parameter partition (a smaller buffer_size is refused before training; DeepSpeed itself
    would assert mid-step), everything else as shipped."""
    cfg = copy.deepcopy(base_cfg)
    op = cfg.setdefault("zero_optimization", {}).setdefault("offload_param", {})
    largest = max(partition_numels(resolve_shape(model), world))
    op["buffer_size"] = max(int(op.get("buffer_size", 0)), largest)
    return cfg


def eqmem_config(base_cfg: dict, sizing: EqmemSizing) -> dict:
    """``base_cfg`` (zero_infinity.json) with the sized values; everything else as shipped."""
    cfg = copy.deepcopy(base_cfg)
    zero = cfg.setdefault("zero_optimization", {})
    zero["sub_group_size"] = sizing.sub_group_size
    op = zero.setdefault("offload_param", {})
    op.update(
        max_in_cpu=sizing.max_in_cpu, buffer_count=sizing.param_buffer_count, buffer_size=sizing.param_buffer_size
    )
    zero.setdefault("offload_optimizer", {})["buffer_count"] = sizing.optimizer_buffer_count
    return cfg
