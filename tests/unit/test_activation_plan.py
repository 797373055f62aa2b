"""The auto policy's plan (aidaptiv_ds.activations.plan) from given costs: keep what the budget holds, store
or recompute the rest by time, store recomputed blocks whose inputs do not fit, and say why for each."""

import pytest

from aidaptiv_ds.activations import plan as P
from aidaptiv_ds.activations.plan import BlockCost

MB = 1 << 20


def block(i, forward_ms=10.0, saved=8 * MB, stored=8 * MB, left=0, inp=1 * MB):
    return BlockCost(
        index=i, forward_s=forward_ms / 1e3, saved_bytes=saved, stored_bytes=stored, left_bytes=left, input_bytes=inp
    )


def modes(plan):
    return [p.mode for p in plan]


def test_keeps_the_last_blocks_the_budget_holds_and_weighs_disk_time_against_recompute():
    costs = [block(i) for i in range(4)]
    # 8 MiB out and back at 1 GiB/s takes 15.6 ms: more than a 10 ms recompute.
    assert modes(P.plan_blocks(costs, 17 * MB + 2 * MB, 1 << 30, 1 << 30)) == ["recompute", "recompute", "keep", "keep"]
    # At 4 GiB/s it takes 3.9 ms: stored.
    plan = P.plan_blocks(costs, 8 * MB, 4 << 30, 4 << 30)
    assert modes(plan) == ["nvme", "nvme", "nvme", "keep"]
    assert "writing and reading 8.00 MiB takes 3.91 ms, less than the 10.00 ms a recompute takes" in plan[0].why
    assert plan[3].why == "kept: its 8.00 MiB fit the budget"


def test_blocks_that_add_the_fewest_bytes_are_kept_first():
    costs = [block(0, saved=2 * MB), block(1, saved=9 * MB), block(2, saved=4 * MB)]
    assert modes(P.plan_blocks(costs, 6 * MB + 1 * MB, 1, 1)) == ["keep", "recompute", "keep"]


def test_recomputed_inputs_that_do_not_fit_are_stored_earliest_first():
    costs = [block(i, inp=2 * MB, left=MB // 4) for i in range(4)]
    # One kept block (8 MiB), then room for one recomputed input beside it and what two stored blocks leave.
    budget = 8 * MB + 2 * MB + 2 * (MB // 4)
    plan = P.plan_blocks(costs, budget, 1, 1)
    assert modes(plan) == ["nvme", "nvme", "recompute", "keep"]
    assert "does not fit the budget beside the kept blocks" in plan[0].why
    s = P.summary(costs, plan, budget, "activations.budget", 1, 1, "given")
    assert s["held_bytes"] == budget and s["fits"]
    assert s["kept_blocks"] == [3] and s["stored_blocks"] == [0, 1] and s["recomputed_layers"] == [2]
    assert s["blocks"][2] == {
        "block": 2,
        "mode": "recompute",
        "why": plan[2].why,
        "forward_ms": 10.0,
        "saved_bytes": 8 * MB,
        "stored_bytes": 8 * MB,
        "left_bytes": MB // 4,
        "input_bytes": 2 * MB,
    }


def test_a_budget_below_what_stored_blocks_leave_is_reported_not_hidden():
    costs = [block(i, left=MB) for i in range(2)]
    plan = P.plan_blocks(costs, MB, 1, 1)
    assert modes(plan) == ["nvme", "nvme"]
    s = P.summary(costs, plan, MB, "activations.budget", 1, 1, "given", unmeasured=[2])
    assert not s["fits"]
    text = P.render(s)
    assert "0 kept, 2 stored on NVMe, 0 recomputed" in text and "over the budget" in text
    assert "block 1: nvme: stored:" in text and "blocks [2] did not run in the measured forward" in text
    with pytest.raises(ValueError, match="bandwidths must be positive"):
        P.plan_blocks(costs, MB, 0, 1)
