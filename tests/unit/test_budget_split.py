"""budget_split's arithmetic on small trainable state (LoRA adapters): it stays resident when it fits."""

from aidaptiv_ds.common.sizes import MiB
from aidaptiv_ds.swap.budget_split import split_budget

# The micro preset under --lora r=8 on q_proj,v_proj with a 64 MiB budget, as its run plans it: four layer
# groups of up to 7 MiB, one optimizer sub-group of 16,384 adapter elements, fp32 (2 chunk-image parts).
GROUPS = [7 * MiB, 7 * MiB, 7 * MiB, 5 * MiB]
ADAPTERS = [16384]


def test_small_sub_group_is_resident_under_the_default_chunk_size():
    split = split_budget(64 * MiB, GROUPS, ADAPTERS, 262144, 4, 2, 1, True)
    assert split.fits
    assert split.resident == {0}
    # chunks in flight are sized by the sub-group they come from, not the configured 262,144 elements
    assert split.chunk_set == 2 * 64 * 1024 + 16384 * 4


def test_chunk_size_is_unchanged_for_sub_groups_larger_than_a_chunk():
    split = split_budget(256 * MiB, GROUPS, [1 << 20, 1 << 20], 1 << 18, 4, 2, 1, True)
    assert split.chunk_set == 2 * (1 << 20) + (1 << 18) * 4


def test_no_resident_state_when_the_cache_is_off():
    assert split_budget(64 * MiB, GROUPS, ADAPTERS, 262144, 4, 2, 1, False).resident == set()


def test_a_larger_budget_never_keeps_less():
    """Across budgets from the minimum to far beyond what the model needs: the resident optimizer state and
    the layer-group slots never shrink as the budget grows, and a budget that holds everything keeps every
    sub-group resident and every group cached. (The tiny preset at 6 GiB kept no sub-group resident, at
    662 MiB most: the room for gradients and chunks was taken twice from a pool sized with it once.)"""
    groups = [26 * MiB] * 2  # tiny, fp32, layer groups of 3 layers
    subs = [7_000_000] * 8 + [2_000_000]
    args = (groups, subs, 1 << 20, 4, 2, 1, True)
    first = split_budget(1 << 30, *args)
    budgets = range(first.minimum, 8 * 2**30, 16 * MiB)
    seen = [split_budget(b, *args) for b in budgets]
    for small, large in zip(seen, seen[1:]):
        assert large.resident_bytes >= small.resident_bytes, (small.budget, large.budget)
        assert large.slots >= small.slots and large.pool >= small.pool
        assert large.pool <= large.budget
    assert seen[-1].resident == set(range(len(subs))) and seen[-1].slots == len(groups)


def test_the_tiny_presets_budgets_from_the_report_keep_more_as_they_grow():
    """The planner's split for tiny (fp32, one rank) with its auto chunk, at the budgets a user reported (662
    MiB, 2 GiB, 6 GiB: 6 GiB kept nothing resident) and between them."""
    from aidaptiv_ds.planner import memory as M
    from aidaptiv_ds.planner.shapes import resolve_shape

    job = M.Job(resolve_shape("tiny"), 64, 2, dtype="fp32")
    hw = M.Hardware(gpus=1, host_mem=1 << 40)
    kept = []  # (budget MiB, optimizer elements resident, layer-group slots)
    for b in range(662, 8192, 128):
        split, _, _, subs, _ = M.aidaptiv_split(job, hw, b * MiB)
        kept.append((b, sum(subs[i] for i in split.resident), split.slots))
    for small, large in zip(kept, kept[1:]):
        assert large[1] >= small[1] and large[2] >= small[2], (small, large)
    assert kept[-1][1] == sum(subs)  # 8 GiB holds tiny's whole optimizer state
