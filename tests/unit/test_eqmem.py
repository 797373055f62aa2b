"""zero_infinity_eqmem: ZeRO-Infinity's host memory sized to aidaptiv's budget (harness/eqmem.py). Each part is
recomputed here from DeepSpeed 0.19.8's allocation rules, independently of the sizing code's loop."""

import json
import os

import pytest
from helpers import REPO

from aidaptiv_ds.harness.eqmem import eqmem_config, size_eqmem
from aidaptiv_ds.harness.grid import GridError, validate_grid
from aidaptiv_ds.planner.memory import _sub_groups, partition_numels
from aidaptiv_ds.planner.shapes import resolve_shape

BASE = json.load(open(os.path.join(REPO, "ds_configs", "zero_infinity.json")))
STATE = 20  # fp32 ZeRO-3 state bytes per parameter, as the grid's aidaptiv_state_fraction counts it


def aligned(numel, elsize=4):
    a = 1024 // elsize  # AIO_ALIGNED_BYTES x intra_op_parallelism 1
    return -(-numel // a) * a


def budget(model, fraction, world=1):
    return int(fraction * STATE * resolve_shape(model).num_parameters / world)


def test_sized_bytes_equal_the_budget_up_to_one_sub_group():
    """tiny at 0.6 of its state, 1 rank: the sizing fills the budget with whole sub-groups of RAM cache; what
    is left is less than the next sub-group, which DeepSpeed could only keep whole."""
    b = budget("tiny", 0.6)
    z = size_eqmem(BASE, "tiny", 1, b)
    parts = partition_numels(resolve_shape("tiny"), 1)
    n, largest = sum(parts), max(parts)
    subs = _sub_groups(parts, z.sub_group_size)
    assert z.sized_bytes <= b and b - z.sized_bytes < z.next_sub_group_bytes
    assert z.over_budget_bytes == 0
    # max_in_cpu is exactly a prefix of whole sub-groups, so no pinned element goes unused
    prefix = [sum(subs[:k]) for k in range(len(subs) + 1)]
    assert z.max_in_cpu == z.cached_numel and z.max_in_cpu in prefix and 0 < z.max_in_cpu < n
    assert z.next_sub_group_bytes == 4 * subs[prefix.index(z.max_in_cpu)]
    assert z.parts["gradient partitions"] == 4 * n
    assert z.parts["parameter swap buffers"] == 5 * aligned(largest) * 4
    assert z.parts["optimizer swap buffers"] == 4 * aligned(max(subs)) * 4
    assert z.parts["optimizer-init gradient buffer"] == 4 * max(subs)
    assert z.parts["parameter RAM cache (max_in_cpu)"] == 4 * z.max_in_cpu
    assert z.parts["parameter write-back buffer"] > 0  # some sub-groups still live on NVMe
    assert z.param_buffer_size == largest  # one buffer holds the largest partition


def test_a_budget_below_zero_infinitys_minimum_runs_the_minimum_and_says_by_how_much():
    """At the cpu_small fraction (0.25) tiny's gradient partitions and smallest swap buffers alone exceed the
    budget: no RAM cache, the smallest sub-groups, and the excess recorded."""
    b = budget("tiny", 0.25)
    z = size_eqmem(BASE, "tiny", 1, b)
    largest = max(partition_numels(resolve_shape("tiny"), 1))
    assert z.max_in_cpu == 0 and z.cached_numel == 0
    assert z.sub_group_size == largest
    assert z.over_budget_bytes == z.sized_bytes - b > 0
    assert z.as_row()["over_budget_bytes"] == z.over_budget_bytes


def test_a_large_budget_caches_every_parameter_and_needs_no_write_back_buffer():
    z = size_eqmem(BASE, "micro", 1, budget("micro", 0.75))
    n = sum(partition_numels(resolve_shape("micro"), 1))
    assert z.cached_numel == z.max_in_cpu == n and z.next_sub_group_bytes is None
    assert "parameter write-back buffer" not in z.parts
    assert z.sized_bytes <= budget("micro", 0.75)


def test_two_ranks_size_each_ranks_partitions_against_its_share():
    b1, b2 = budget("tiny", 0.6), budget("tiny", 0.6, world=2)
    z = size_eqmem(BASE, "tiny", 2, b2)
    parts = partition_numels(resolve_shape("tiny"), 2)
    assert z.partition_numel == sum(parts) and z.param_buffer_size == max(parts)
    assert z.parts["gradient partitions"] == 4 * sum(parts)
    assert z.sized_bytes <= b2 < b1
    # the write-back buffer is sized with full (unpartitioned) numels, as stage3 does
    assert z.parts["parameter write-back buffer"] >= 2 * 4 * aligned(max(parts)) - 4096


def test_the_config_changes_only_the_sized_settings():
    z = size_eqmem(BASE, "tiny", 1, budget("tiny", 0.6))
    cfg = eqmem_config(BASE, z)
    zo, zb = cfg["zero_optimization"], BASE["zero_optimization"]
    assert zo["offload_param"]["max_in_cpu"] == z.max_in_cpu and zb["offload_param"]["max_in_cpu"] == 0
    assert zo["offload_param"]["buffer_size"] == z.param_buffer_size
    assert zo["sub_group_size"] == z.sub_group_size
    assert zo["offload_optimizer"]["buffer_count"] == 4
    for k in ("device", "nvme_path", "pin_memory"):
        assert zo["offload_param"][k] == zb["offload_param"][k]
    rest = {k: v for k, v in cfg.items() if k != "zero_optimization"}
    assert rest == {k: v for k, v in BASE.items() if k != "zero_optimization"}


def test_a_grid_with_eqmem_needs_an_aidaptiv_fraction():
    grid = {
        "notes": "n",
        "models": ["tiny", "small"],
        "micro_batches": [1],
        "seq_lens": [64],
        "gpus": [1],
        "steps": 3,
        "warmup": 1,
        "timeout_s": 60,
        "backends": ["aidaptiv", "zero_infinity_eqmem"],
        "per_model": {"small": {"aidaptiv_state_fraction": 0.4}},
    }
    with pytest.raises(GridError) as e:
        validate_grid(grid)
    assert "zero_infinity_eqmem" in str(e.value) and "['tiny']" in str(e.value)
    grid["aidaptiv_state_fraction"] = 0.6
    assert validate_grid(grid).backends == ["aidaptiv", "zero_infinity_eqmem"]


def test_documented_config_sizes_the_parameter_buffers_to_the_largest_parameter():
    from aidaptiv_ds.harness.eqmem import documented_config

    base = BASE
    shipped = base["zero_optimization"]["offload_param"]["buffer_size"]
    assert documented_config(base, "tiny") == base  # tiny's largest parameter fits the shipped buffers
    big = documented_config(base, "tinyllama-1.1b")
    assert big["zero_optimization"]["offload_param"]["buffer_size"] == 32000 * 2048 > shipped  # the embedding
    assert documented_config(base, "tinyllama-1.1b", world=2)["zero_optimization"]["offload_param"][
        "buffer_size"
    ] == max(shipped, 32000 * 1024)
    assert base["zero_optimization"]["offload_param"]["buffer_size"] == shipped  # the input is not changed
