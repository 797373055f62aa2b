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
