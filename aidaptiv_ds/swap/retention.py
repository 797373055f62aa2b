"""How many layer groups a host budget can retain across the forward/backward turn (``aidaptiv.retention_budget``).

Retention is sized after everything else the swapper cannot do without (:func:`aidaptiv_ds.swap.budget_split.split_budget`'s
``minimum``: the prefetch slots and the room for gradients and optimizer chunks, that room twice): it comes out of what would
otherwise hold optimizer sub-groups resident or cache more groups elastically. Each retained group takes one
layer-group slot (the largest group's size), so a budget buys whole groups, counted from the end of the
forward. Plain arithmetic on byte counts, shared by the run's plan (:mod:`aidaptiv_ds.zero3.plan`) and
anything that predicts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from aidaptiv_ds.common.sizes import MiB
from aidaptiv_ds.swap.budget_split import BudgetSplit, retention_slots


@dataclass(frozen=True)
class Retention:
    groups: int  # the last ``groups`` layer groups of the forward are retained
    slot_bytes: int  # host memory they take: one slot each
    group_bytes: int  # their own bytes: what the backward no longer reads


def retention_that_fits(split: BudgetSplit, group_bytes: Sequence[int]) -> Retention:
    """The most the budget of ``split`` (a split without retention) can retain: whole slots of what it
    holds beyond the swapper's minimum, at most every group."""
    n = retention_slots(split.budget, split.minimum, split.general, split.slot, len(group_bytes))
    return Retention(n, n * split.slot, sum(group_bytes[len(group_bytes) - n :]) if n else 0)


def plan_retention(requested: int, split: BudgetSplit, group_bytes: Sequence[int]) -> Retention:
    """The retention a ``retention_budget`` of ``requested`` bytes gets (whole slots). Raises ValueError,
    naming the setting and what fits, when the bytes asked for are more than fit."""
    fits = retention_that_fits(split, group_bytes)
    n = min(len(group_bytes), int(requested) // split.slot) if split.slot else 0
    if n > fits.groups:
        raise ValueError(
            f"aidaptiv.retention_budget is {int(requested) / MiB:.1f} MiB ({n} layer-group slots of "
            f"{split.slot / MiB:.1f} MiB) but the {split.budget / MiB:.1f} MiB host budget holds "
            f"{fits.slot_bytes / MiB:.1f} MiB ({fits.groups} slots) beyond the swapper's minimum of "
            f"{split.minimum / MiB:.1f} MiB and {split.general / MiB:.1f} MiB more for gradients and optimizer "
            "chunks: lower it to at most that, or raise aidaptiv.host_memory_budget"
        )
    return Retention(n, n * split.slot, sum(group_bytes[len(group_bytes) - n :]) if n else 0)
