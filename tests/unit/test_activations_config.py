"""The "activations" object of the aidaptiv block: defaults, every problem reported, resolution."""

import pytest

from aidaptiv_ds.config import settings as C
from aidaptiv_ds.config.ds_config import ConfigError


def settings(**activations):
    block = {"enabled": True, "nvme_path": "/tmp", "host_memory_budget": "1GiB"}
    if activations:
        block["activations"] = activations
    return C.SwapSettings.from_block(block)


def test_defaults_keep_activations_and_chunk_the_loss():
    a = settings().activations
    assert a == C.ActivationSettings(
        policy="keep", loss_chunk_tokens=1024, read_ahead=2, min_bytes=64 * 1024, budget=None, nvme_bandwidth=None
    )


def test_resolved_and_round_trips_through_the_translated_block():
    s = settings(policy="nvme", loss_chunk_tokens=0, read_ahead=4)
    assert s.activations.policy == "nvme" and s.activations.loss_chunk_tokens == 0 and s.activations.read_ahead == 4
    assert C.SwapSettings.from_block(s.block()) == s


def test_auto_is_accepted_with_its_budget_and_bandwidth_resolved():
    a = settings(policy="auto", budget="64MiB", nvme_bandwidth="2GiB/s").activations
    assert a.policy == "auto" and a.budget == 64 << 20 and a.nvme_bandwidth == float(2 << 30)
    s = settings(policy="auto")
    assert s.activations.budget is None and s.activations.nvme_bandwidth is None  # "auto": measured
    assert s.block()["activations"]["budget"] == "auto" and C.SwapSettings.from_block(s.block()) == s
    assert settings(policy="auto", budget=0, nvme_bandwidth=5e8).activations.budget == 0


def test_every_problem_at_once_with_the_nested_names():
    with pytest.raises(ConfigError) as e:
        settings(policy="offload", read_ahead=-1, loss_chunk_tokens=-5, spill=True, budget="lots", nvme_bandwidth=0)
    text = "\n".join(e.value.problems)
    assert len(e.value.problems) == 6
    assert "aidaptiv.activations.policy" in text and "'keep', 'recompute', 'nvme' or 'auto'" in text
    assert "aidaptiv.activations.read_ahead" in text and "aidaptiv.activations.loss_chunk_tokens" in text
    assert (
        "aidaptiv.activations.spill: unknown setting (known: budget, loss_chunk_tokens, min_bytes, "
        "nvme_bandwidth, policy, read_ahead)" in text
    )
    assert "aidaptiv.activations.budget: Value error, budget='lots' is not a size" in text
    assert "aidaptiv.activations.nvme_bandwidth" in text and "above 0 bytes/s" in text


def test_budget_and_bandwidth_belong_to_auto():
    with pytest.raises(
        ConfigError, match='budget and nvme_bandwidth apply to policy "auto" only, but the policy is "nvme"'
    ):
        settings(policy="nvme", budget="1GiB", nvme_bandwidth=1e9)
    with pytest.raises(ConfigError, match='budget applies to policy "auto" only'):
        settings(budget="1GiB")
