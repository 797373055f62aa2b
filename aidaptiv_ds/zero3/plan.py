"""How a run uses its host budget: the pinned pool's size, the staging it needs, what stays resident.

Staging is what moving the model needs at any moment: in forward and backward, the layer group being
computed, the ones being prefetched and one cached across the turn, plus open gradient buffers; in the
optimizer step, the sub-group being updated, the read-ahead and the write-behind. The two phases do not
overlap, so the larger of the two is reserved. What the budget has beyond that goes first to the slots
of any retention (``aidaptiv.retention_budget``: the last layer groups of the forward, kept until the
backward has used them), then holds optimizer sub-groups resident (the RAM cache tier): each one saves
reading and writing 12-16 bytes per parameter every step, which is on the step's critical path, whereas
parameter reads overlap compute. Whatever is not resident is cached elastically (least recently used
layer groups, gradients) and given back on demand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Set

import torch

from aidaptiv_ds.common.sizes import MiB, dtype_bytes
from aidaptiv_ds.config.ds_config import ConfigError
from aidaptiv_ds.swap.budget_split import fit_prefetch_depth, shrink_layer_groups, split_budget
from aidaptiv_ds.swap.chunk_layout import PARTS
from aidaptiv_ds.swap.retention import plan_retention
from aidaptiv_ds.zero3.layer_groups import partition_into_groups

log = logging.getLogger(__name__)


@dataclass
class RunPlan:
    budget_bytes: int
    pool_bytes: int
    staging_bytes: int
    group_bytes: List[int]
    sub_group_numels: List[int]
    chunk_numel: int
    layer_group_size: int
    resident_sub_groups: Set[int] = field(default_factory=set)
    group_slots: int = 0
    resident_bytes: int = 0
    retained_groups: int = 0  # the last layer groups of the forward, kept until the backward uses them
    retained_bytes: int = 0
    prefetch_depth: int = 1  # the configured depth, or lower where the budget cannot hold its slots

    def describe(self) -> str:
        res = self.resident_bytes
        kept = (
            f", last {self.retained_groups} layer groups retained ({self.retained_bytes / MiB:.1f} MiB)"
            if self.retained_groups
            else ""
        )
        return (
            f"{len(self.group_bytes)} layer groups of up to {self.layer_group_size} layers (largest "
            f"{max(self.group_bytes) / MiB:.1f} MiB), "
            f"{len(self.sub_group_numels)} optimizer sub-groups ({len(self.resident_sub_groups)} resident, "
            f"streamed in chunks of {self.chunk_numel:,} elements; "
            f"{res / MiB:.1f} MiB), pinned pool {self.pool_bytes / MiB:.1f} MiB of a "
            f"{self.budget_bytes / MiB:.1f} MiB budget, {self.group_slots} layer-group slots{kept}, minimum "
            f"{self.staging_bytes / MiB:.1f} MiB"
        )


def _group_bytes(records, module, layer_group_size: int) -> List[int]:
    seen, out = set(), []
    for _, params in partition_into_groups(module, layer_group_size):
        size = 0
        for p in params:
            rec = records.get(getattr(p, "ds_id", None))
            if rec is not None and p.ds_id not in seen:
                seen.add(p.ds_id)
                size += rec.extent.reserved
        if size:
            out.append(size)
    rest = sum(r.extent.reserved for i, r in records.items() if i not in seen)
    return out + ([rest] if rest else [])


def plan_run(runtime, module, sub_group_numels: List[int]) -> RunPlan:
    cfg = runtime.cfg  # SwapSettings: budget and chunk already resolved
    budget = cfg.host_budget_bytes
    records = runtime.param_swapper.records
    # The configured layer_group_size is an upper bound (see budget_split.shrink_layer_groups).
    layer_group_size, group_bytes = shrink_layer_groups(
        cfg.layer_group_size, cfg.prefetch_depth, budget, lambda size: _group_bytes(records, module, size)
    )
    if layer_group_size != cfg.layer_group_size:
        log.info(
            "aidaptiv: layer groups of %d layers instead of %d, so that prefetching %d ahead fits the "
            "%.1f MiB host budget",
            layer_group_size,
            cfg.layer_group_size,
            cfg.prefetch_depth,
            budget / MiB,
        )
    parts = 2 if runtime.model_dtype == torch.float32 else PARTS  # chunk image parts (fp32: no master)

    def args(depth):
        return (
            budget,
            group_bytes,
            sub_group_numels,
            cfg.optimizer_chunk_numel,
            dtype_bytes(runtime.model_dtype),
            parts,
            depth,
            cfg.cache_optimizer_state,
        )

    # The configured prefetch depth is an upper bound too (see budget_split.fit_prefetch_depth).
    split = fit_prefetch_depth(cfg.prefetch_depth, lambda depth: split_budget(*args(depth)))
    if not split.fits:
        raise ConfigError([split.shortfall()])
    if split.prefetch_depth != cfg.prefetch_depth:
        log.warning(
            "aidaptiv: prefetch depth %d instead of %d: the %.1f MiB host budget cannot hold %d slots of the "
            "largest layer group (%.1f MiB); reads ahead need %.1f MiB",
            split.prefetch_depth,
            cfg.prefetch_depth,
            budget / MiB,
            cfg.prefetch_depth + 2,
            split.slot / MiB,
            split_budget(*args(cfg.prefetch_depth)).minimum / MiB,
        )
    if cfg.retention_budget:
        try:
            retention = plan_retention(cfg.retention_budget, split, group_bytes)
        except ValueError as err:
            raise ConfigError([str(err)]) from None
        split = split_budget(*args(split.prefetch_depth), retain_groups=retention.groups)
    return RunPlan(
        budget,
        split.pool,
        split.minimum,
        group_bytes,
        list(sub_group_numels),
        cfg.optimizer_chunk_numel,
        layer_group_size,
        split.resident,
        split.slots,
        split.resident_bytes,
        split.retained_groups,
        split.retained_bytes,
        split.prefetch_depth,
    )
