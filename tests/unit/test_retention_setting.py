"""retention_budget: validated with the rest of the block, sized by the planner after the swapper's minimum."""

import pytest

from aidaptiv_ds.common.sizes import MiB
from aidaptiv_ds.config.ds_config import ConfigError
from aidaptiv_ds.config.host import check_host_budget
from aidaptiv_ds.config.schema import _parse_block
from aidaptiv_ds.config.settings import SwapSettings
from aidaptiv_ds.swap.budget_split import split_budget
from aidaptiv_ds.swap.retention import plan_retention, retention_that_fits

GROUPS = [8 * MiB] * 6 + [4 * MiB]


def split(budget, retain=0):
    return split_budget(budget, GROUPS, [1 << 20] * 4, 1 << 18, 4, 2, 1, True, retain_groups=retain)


def test_setting_parses_and_survives_the_resolved_block():
    s = SwapSettings.from_block(
        {"enabled": True, "nvme_path": "/tmp", "host_memory_budget": "1GiB", "retention_budget": "64MiB"}
    )
    assert s.retention_budget == 64 * MiB and SwapSettings.from_block(s.block()) == s
    with pytest.raises(ConfigError, match="retention_budget"):
        _parse_block({"enabled": True, "retention_budget": "lots"})


def test_retention_as_large_as_the_budget_is_refused_with_the_other_problems():
    cfg = _parse_block(
        {"enabled": True, "nvme_path": "/tmp", "host_memory_budget": "100MiB", "retention_budget": "100MiB"}
    )
    problems = check_host_budget(cfg, ram_bytes=1 << 40, local_ranks=1)
    assert len(problems) == 1 and "retention_budget" in problems[0] and "100.0 MiB" in problems[0]


def test_planner_retains_whole_slots_beyond_the_minimum_and_takes_them_first():
    base = split(80 * MiB)
    fits = retention_that_fits(base, GROUPS)
    assert fits.groups == (80 * MiB - base.minimum - base.general) // base.slot == 3
    assert plan_retention(fits.slot_bytes, base, GROUPS) == fits
    with pytest.raises(ValueError, match="aidaptiv.retention_budget"):
        plan_retention(fits.slot_bytes + base.slot, base, GROUPS)
    kept = split(80 * MiB, fits.groups)
    assert kept.retained_groups == fits.groups and kept.retained_bytes == sum(GROUPS[-fits.groups :])
    assert kept.slots >= base.min_slots + fits.groups
    assert split(1 << 40).retained_groups == 0 and retention_that_fits(split(1 << 40), GROUPS).groups == len(GROUPS)
    assert len(kept.resident) <= len(base.resident)  # retention comes out of the resident optimizer state
