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

from aidaptiv_ds.config import ConfigError
from aidaptiv_ds.store import align_up
from aidaptiv_ds.zero3.layer_groups import partition_into_groups
from aidaptiv_ds.config import optimizer_chunk_numel
from aidaptiv_ds.zero3.optimizer_swapper import PARTS, READ_AHEAD

MiB = 2**20
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

    def describe(self) -> str:
        res = sum((PARTS + 1) * align_up(self.sub_group_numels[i] * 4) for i in self.resident_sub_groups)
        return (f"{len(self.group_bytes)} layer groups of up to {self.layer_group_size} layers (largest "
                f"{max(self.group_bytes) / MiB:.1f} MiB), "
                f"{len(self.sub_group_numels)} optimizer sub-groups ({len(self.resident_sub_groups)} resident, "
                f"streamed in chunks of {self.chunk_numel:,} elements; "
                f"{res / MiB:.1f} MiB), pinned pool {self.pool_bytes / MiB:.1f} MiB of a "
                f"{self.budget_bytes / MiB:.1f} MiB budget, staging {self.staging_bytes / MiB:.1f} MiB")


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
    cfg = runtime.cfg
    budget = cfg.host_budget_bytes()
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
    chunk = optimizer_chunk_numel(cfg)
    largest_group = max(group_bytes)
    largest_sub = max(sub_group_numels)
    elsize = torch_elsize(runtime.model_dtype)
    # forward/backward: the group computing, the ones being prefetched, one kept across the turn, and the
    # gradient buffers of about two sub-groups being filled.
    fwd_bwd = (cfg.prefetch_depth + 2) * largest_group + 2 * part(largest_sub)
    # step: the sub-group's gradient, chunks being updated / read ahead / written behind, and the
    # updated parameters on their way to disk.
    chunk_set = PARTS * part(chunk) + chunk * elsize  # image (or moments + the fp32 parameters as masters)
    step = part(largest_sub) + (2 + READ_AHEAD) * chunk_set
    minimum = max(largest_group + part(largest_sub), part(largest_sub) + chunk_set)
    if budget < minimum:
        raise ConfigError([
            f"aidaptiv.host_memory_budget is {budget / MiB:.1f} MiB but the run needs at least {minimum / MiB:.1f} "
            f"MiB of host memory (largest layer group {largest_group / MiB:.1f} MiB, gradient of the largest "
            f"optimizer sub-group {part(largest_sub) / MiB:.1f} MiB, optimizer chunk {chunk_set / MiB:.1f} MiB): "
            "raise the budget, or lower aidaptiv.layer_group_size or optimizer_chunk_numel"])
    staging = max(fwd_bwd, step)
    resident_cost = lambda n: (PARTS + 1) * part(n)  # chunk images and gradient
    everything = staging + sum(group_bytes) + sum(resident_cost(n) for n in sub_group_numels)
    pool = min(budget, everything)
    resident = set()
    if cfg.cache_optimizer_state:
        leftover = pool - staging
        for i, n in enumerate(sub_group_numels):  # the step starts with sub-group 0: keep the first ones
            if resident_cost(n) > leftover:
                break
            resident.add(i)
            leftover -= resident_cost(n)
    return RunPlan(budget, pool, min(staging, pool), group_bytes, list(sub_group_numels), chunk, layer_group_size,
                   resident)


def torch_elsize(dtype) -> int:
    import torch
    return torch.empty(0, dtype=dtype).element_size()
