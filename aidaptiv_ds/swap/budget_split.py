"""How an aidaptiv host budget splits, as arithmetic on byte counts: what the swapper's plan
(``aidaptiv_ds.zero3.plan.plan_run``) does with a built model and what the planner (``aidaptiv_ds.planner``)
predicts for a model that does not exist yet. One copy of the arithmetic, so the prediction cannot drift
from the run.

Inputs are plain numbers: the bytes of each layer group (4 KiB-aligned partitions of this rank), the
elements of each optimizer sub-group, the chunk size, the element size, and the parts of a chunk image.
This module imports nothing but :mod:`aidaptiv_ds.common.sizes` (no torch, no DeepSpeed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Sequence, Set, Tuple

from aidaptiv_ds.common.sizes import MiB, align_up

# Optimizer chunks the plan reserves room for ahead of the one being updated (the streamed step reads
# further ahead only when memory allows).
READ_AHEAD = 2
# The least room for gradients and chunks: a checkpoint's transfer buffer is taken from it at a save (a LoRA
# run's few thousand trainable elements would otherwise leave less than a save needs).
TRANSFER_MIN = 1 << 20


def fp32_part(numel: int) -> int:
    """Bytes of one fp32 vector of ``numel`` elements, padded to 4 KiB (a part of a chunk image)."""
    return align_up(numel * 4)


def shrink_layer_groups(
    layer_group_size: int, prefetch_depth: int, budget: int, group_bytes_for: Callable[[int], List[int]]
) -> Tuple[int, List[int]]:
    """(layer groups' size, their bytes): the configured size is an upper bound, lowered until the group
    computing, the ``prefetch_depth`` being prefetched and one kept across the forward/backward turn fit
    in half the budget, or prefetch could never run ahead (and every group would be read on demand).
    ``group_bytes_for(size)`` gives the groups' bytes for a size."""
    group_bytes = group_bytes_for(layer_group_size)
    while layer_group_size > 1 and (prefetch_depth + 2) * max(group_bytes) > budget // 2:
        layer_group_size -= 1
        group_bytes = group_bytes_for(layer_group_size)
    return layer_group_size, group_bytes


@dataclass
class BudgetSplit:
    """What the budget holds: ``minimum`` (slots for prefetch and the room ``general`` for a gradient
    buffer and optimizer chunks in flight) must fit; the pool is what the run pins."""

    budget: int
    prefetch_depth: int
    slot: int  # bytes of one layer-group slot (the largest group's, aligned)
    min_slots: int
    general: int  # gradient of the largest sub-group + optimizer chunk sets in flight
    chunk_set: int  # one chunk's image and its converted parameters
    largest_sub_grad: int
    minimum: int
    pool: int = 0
    slots: int = 0
    resident: Set[int] = field(default_factory=set)
    resident_bytes: int = 0
    retained_groups: int = 0  # the last layer groups of the forward kept until the backward uses them
    retained_bytes: int = 0  # their bytes (each takes one slot)

    @property
    def fits(self) -> bool:
        return self.budget >= self.minimum

    def shortfall(self) -> str:
        """The problem of a budget below the minimum, as ``aidaptiv.host_memory_budget`` reports it."""
        # The minimum rounded up (and the budget down) to what is shown: a budget 0.04 MiB short must not
        # read "24.0 MiB but needs at least 24.0 MiB".
        need = math.ceil(self.minimum / MiB * 10) / 10
        have = math.floor(self.budget / MiB * 10) / 10
        return (
            f"aidaptiv.host_memory_budget is {have:.1f} MiB ({self.budget:,} bytes) but the run needs at "
            f"least {need:.1f} MiB ({self.minimum:,} bytes) of host memory ({self.min_slots} layer-group slots of "
            f"{self.slot / MiB:.1f} MiB for prefetch depth {self.prefetch_depth}, the gradient of the largest "
            f"optimizer sub-group {self.largest_sub_grad / MiB:.1f} MiB, optimizer chunks of "
            f"{self.chunk_set / MiB:.1f} MiB): raise the budget, or lower aidaptiv.layer_group_size, "
            "prefetch_depth or optimizer_chunk_numel"
        )


def fit_prefetch_depth(prefetch_depth: int, split_for: Callable[[int], "BudgetSplit"]) -> "BudgetSplit":
    """The split at the configured ``prefetch_depth`` or, when its minimum does not fit the budget, at the
    deepest lower depth whose minimum does (0: each group is read when it is needed, none ahead): like the
    group size, the depth is an upper bound. A model whose largest group is its embedding (Qwen2.5-3B's 1.2 GB)
    needs a slot of that size per group in flight, so a budget that trains it without read-ahead would
    otherwise be refused. When no depth fits, the configured depth's split (its shortfall says what to do).
    ``split_for(depth)`` gives the split at a depth."""
    first = split_for(prefetch_depth)
    if first.fits:
        return first
    for depth in range(prefetch_depth - 1, -1, -1):
        split = split_for(depth)
        if split.fits:
            return split
    return first


def retention_slots(budget: int, minimum: int, general: int, slot: int, groups: int) -> int:
    """Layer groups that can be retained across the forward/backward turn: whole slots of what the budget
    holds beyond ``minimum`` and a second ``general`` (the room for gradients and optimizer chunks that
    :func:`split_budget` doubles before anything else: with the minimum's alone, a tiny-preset run ran out
    of room for a gradient buffer), at most every group."""
    return max(0, min(groups, (budget - minimum - general) // slot)) if slot > 0 else 0


def split_budget(
    budget: int,
    group_bytes: Sequence[int],
    sub_group_numels: Sequence[int],
    chunk_numel: int,
    elsize: int,
    parts: int,
    prefetch_depth: int,
    cache_optimizer_state: bool,
    retain_groups: int = 0,
) -> BudgetSplit:
    """Split ``budget`` (bytes of this rank) between layer-group slots, resident optimizer sub-groups and
    the elastic rest. ``parts``: fp32 vectors per chunk image (3 with a separate master, 2 for fp32
    models). ``retain_groups``: slots set aside, before anything else beyond the minimum, for the last
    layer groups of the forward (:func:`retention_slots` says how many fit). A split whose ``fits`` is
    False has no pool, slots or resident sub-groups."""
    slot = align_up(max(group_bytes))  # every layer group occupies one slot of the largest group's size
    # A chunk never spans two sub-groups (chunk_layout cuts each sub-group on its own), so no chunk is
    # larger than the largest sub-group: sized at the configured chunk instead, the chunks in flight of a
    # LoRA run (a few thousand trainable elements) took the room that would keep its optimizer state resident.
    chunk_numel = min(chunk_numel, max(sub_group_numels))
    # Slots: the group computing, the ones being prefetched, and one more (the forward/backward turn,
    # or the group whose update is being applied).
    min_slots = prefetch_depth + 2
    # Everything else: the gradient buffer of the largest sub-group, and optimizer chunks being updated,
    # read ahead and written behind (with the updated parameters on their way to disk).
    chunk_set = parts * fp32_part(chunk_numel) + chunk_numel * elsize
    largest_sub_grad = fp32_part(max(sub_group_numels))
    general = max(TRANSFER_MIN, largest_sub_grad + (2 + READ_AHEAD) * chunk_set)
    minimum = min_slots * slot + general
    split = BudgetSplit(budget, prefetch_depth, slot, min_slots, general, chunk_set, largest_sub_grad, minimum)
    if not split.fits:
        return split
    retain_groups = min(retain_groups, len(group_bytes))
    if retain_groups > retention_slots(budget, minimum, general, slot, len(group_bytes)):
        raise ValueError(
            f"{retain_groups} retained layer groups of {slot} bytes do not fit the {budget} bytes "
            f"left beyond the minimum {minimum}: ask retention_slots how many do"
        )
    resident_cost = lambda n: parts * fp32_part(n) + fp32_part(n)  # chunk images and gradient, in host memory
    # All the budget can use: every group cached (and never fewer slots than the minimum's, which a model of
    # fewer groups than prefetch needs still takes), every sub-group resident, and the room for gradients and
    # chunks twice (the minimum's and the second one below). Sized with that room once and the groups' count,
    # a budget larger than the model needs lost it to the subtractions below and kept fewer sub-groups
    # resident than a smaller budget (the tiny preset: none at 6 GiB, most at 662 MiB).
    slots_at_most = max(len(group_bytes), min_slots)
    everything = slots_at_most * slot + sum(resident_cost(n) for n in sub_group_numels) + 2 * general
    pool = min(budget, everything)
    # What the budget has beyond the minimum goes, in this order, to: twice the minimum room for
    # gradients and chunks (gradients kept in memory save a write and a read each), optimizer sub-groups
    # kept resident (they save reading and writing their moments every step, on the update's critical
    # path), and more slots to cache layer groups across the forward/backward turn and into the next step.
    retained = retain_groups * slot
    leftover = pool - minimum - retained - general
    resident = set()
    if cache_optimizer_state and leftover > 0:
        for i, n in enumerate(sub_group_numels):
            if resident_cost(n) <= leftover:
                resident.add(i)
                leftover -= resident_cost(n)
    split.pool = pool
    split.slots = min(len(group_bytes), min_slots + retain_groups + max(0, leftover) // slot)
    split.retained_groups = retain_groups
    split.retained_bytes = sum(group_bytes[len(group_bytes) - retain_groups :])
    split.resident = resident
    split.resident_bytes = sum(resident_cost(sub_group_numels[i]) for i in resident)
    return split
