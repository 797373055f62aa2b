"""budget_split's arithmetic on small trainable state (LoRA adapters): it stays resident when it fits."""

from aidaptiv_ds.common.sizes import MiB, align_up
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


def test_prefetch_depth_is_lowered_to_what_the_budget_holds():
    """A large first group (Qwen2.5-3B's 1.2 GB embedding) makes every slot that large: prefetching one group
    ahead needs three of them. The configured depth is an upper bound, lowered to the deepest that fits; when
    none does, the configured depth's shortfall is what the run reports."""
    from aidaptiv_ds.swap.budget_split import fit_prefetch_depth

    groups = [1187 * MiB] + [308 * MiB] * 36
    args = ([7_000_000] * 4, 1 << 20, 4, 2)

    def split_for(budget):
        return lambda depth: split_budget(budget, groups, *args, depth, True)

    need = {d: split_for(8 * 2**30)(d).minimum for d in (0, 1, 2)}
    assert need[0] < need[1] < need[2] and need[1] - need[0] == align_up(1187 * MiB)
    assert fit_prefetch_depth(2, split_for(need[2])).prefetch_depth == 2  # fits as configured
    assert fit_prefetch_depth(2, split_for(need[1])).prefetch_depth == 1
    lowered = fit_prefetch_depth(1, split_for(need[0]))
    assert lowered.fits and lowered.prefetch_depth == 0 and lowered.min_slots == 2
    refused = fit_prefetch_depth(1, split_for(need[0] - 1))
    assert not refused.fits and refused.prefetch_depth == 1 and "prefetch depth 1" in refused.shortfall()


def test_the_planner_trains_qwen_3b_without_read_ahead_where_reading_ahead_does_not_fit():
    from aidaptiv_ds.planner.memory import Hardware, Job, plan_backend
    from aidaptiv_ds.planner.shapes import resolve_shape

    def plan(budget_gib, depth):
        job = Job(resolve_shape("qwen2.5-3b"), 128, 1, dtype="fp32", host_budget=int(budget_gib * 2**30))
        job.prefetch_depth = depth
        return plan_backend("aidaptiv", job, Hardware(gpus=1, host_mem=64 << 30))

    assert plan(4, 0).split.fits
    lowered = plan(4, 1)  # 4 GiB holds two 1187 MiB slots and the optimizer's room, not three
    assert lowered.split.fits and lowered.settings["prefetch_depth"] == 0
    assert plan(6, 1).settings["prefetch_depth"] == 1
