"""How a run uses its host budget: the pinned pool's size, the staging it needs, what stays resident.

Staging is what moving the model needs at any moment: in forward and backward, the layer group being
computed, the ones being prefetched and one cached across the turn, plus open gradient buffers; in the
optimizer step, the sub-group being updated, the read-ahead and the write-behind. The two phases do not
overlap, so the larger of the two is reserved. What the budget has beyond that holds optimizer
sub-groups resident (the RAM cache tier): each one saves reading and writing 12-16 bytes per parameter
every step, which is on the step's critical path, whereas parameter reads overlap compute. Whatever is
not resident is cached elastically (least recently used layer groups, gradients) and given back on demand.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Set

import torch

from aidaptiv_ds.ds_config import ConfigError
from aidaptiv_ds.sizes import MiB, align_up, dtype_bytes
from aidaptiv_ds.zero3.layer_groups import partition_into_groups
from aidaptiv_ds.zero3.optimizer_swapper import PARTS, READ_AHEAD

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

    def describe(self) -> str:
        res = self.resident_bytes
        return (f"{len(self.group_bytes)} layer groups of up to {self.layer_group_size} layers (largest "
                f"{max(self.group_bytes) / MiB:.1f} MiB), "
                f"{len(self.sub_group_numels)} optimizer sub-groups ({len(self.resident_sub_groups)} resident, "
                f"streamed in chunks of {self.chunk_numel:,} elements; "
                f"{res / MiB:.1f} MiB), pinned pool {self.pool_bytes / MiB:.1f} MiB of a "
                f"{self.budget_bytes / MiB:.1f} MiB budget, {self.group_slots} layer-group slots, minimum "
                f"{self.staging_bytes / MiB:.1f} MiB")


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
    # The configured layer_group_size is an upper bound: groups shrink until the one computing, the ones
    # prefetched and one kept across the forward/backward turn fit in half the budget, or prefetch could
    # never run ahead (and every group would be read on demand).
    layer_group_size = cfg.layer_group_size
    group_bytes = _group_bytes(records, module, layer_group_size)
    while layer_group_size > 1 and (cfg.prefetch_depth + 2) * max(group_bytes) > budget // 2:
        layer_group_size -= 1
        group_bytes = _group_bytes(records, module, layer_group_size)
    if layer_group_size != cfg.layer_group_size:
        log.info("aidaptiv: layer groups of %d layers instead of %d, so that prefetching %d ahead fits the "
                 "%.1f MiB host budget", layer_group_size, cfg.layer_group_size, cfg.prefetch_depth, budget / MiB)
    part = lambda n: align_up(n * 4)  # one fp32 vector of a sub-group
    chunk = cfg.optimizer_chunk_numel
    slot = align_up(max(group_bytes))  # every layer group occupies one slot of the largest group's size
    largest_sub = max(sub_group_numels)
    elsize = dtype_bytes(runtime.model_dtype)
    parts = 2 if runtime.model_dtype == torch.float32 else PARTS  # chunk image parts (fp32: no master)
    # Slots: the group computing, the ones being prefetched, and one more (the forward/backward turn,
    # or the group whose update is being applied).
    min_slots = cfg.prefetch_depth + 2
    # Everything else: the gradient buffer of the largest sub-group, and optimizer chunks being updated,
    # read ahead and written behind (with the updated parameters on their way to disk).
    chunk_set = parts * part(chunk) + chunk * elsize
    general = part(largest_sub) + (2 + READ_AHEAD) * chunk_set
    minimum = min_slots * slot + general
    if budget < minimum:
        raise ConfigError([
            f"aidaptiv.host_memory_budget is {budget / MiB:.1f} MiB but the run needs at least {minimum / MiB:.1f} "
            f"MiB of host memory ({min_slots} layer-group slots of {slot / MiB:.1f} MiB for prefetch depth "
            f"{cfg.prefetch_depth}, the gradient of the largest optimizer sub-group {part(largest_sub) / MiB:.1f} "
            f"MiB, optimizer chunks of {chunk_set / MiB:.1f} MiB): raise the budget, or lower "
            "aidaptiv.layer_group_size, prefetch_depth or optimizer_chunk_numel"])
    resident_cost = lambda n: parts * part(n) + part(n)  # chunk images and gradient, in host memory
    everything = len(group_bytes) * slot + sum(resident_cost(n) for n in sub_group_numels) + general
    pool = min(budget, everything)
    # What the budget has beyond the minimum goes, in this order, to: twice the minimum room for
    # gradients and chunks (gradients kept in memory save a write and a read each), optimizer sub-groups
    # kept resident (they save reading and writing their moments every step, on the update's critical
    # path), and more slots to cache layer groups across the forward/backward turn and into the next step.
    leftover = pool - minimum - general
    resident = set()
    if cfg.cache_optimizer_state and leftover > 0:
        for i, n in enumerate(sub_group_numels):
            if resident_cost(n) <= leftover:
                resident.add(i)
                leftover -= resident_cost(n)
    slots = min(len(group_bytes), min_slots + max(0, leftover) // slot)
    return RunPlan(budget, pool, min_slots * slot + general, group_bytes, list(sub_group_numels), chunk,
                   layer_group_size, resident, slots, sum(resident_cost(sub_group_numels[i]) for i in resident))
