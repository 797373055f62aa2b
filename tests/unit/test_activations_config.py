"""The "activations" object of the aidaptiv block: defaults, every problem reported, resolution."""
import pytest

from aidaptiv_ds import config as C
from aidaptiv_ds.ds_config import ConfigError


def settings(**activations):
    block = {"enabled": True, "nvme_path": "/tmp", "host_memory_budget": "1GiB"}
    if activations:
        block["activations"] = activations
    return C.SwapSettings.from_block(block)


def test_defaults_keep_activations_and_chunk_the_loss():
    a = settings().activations
    assert a == C.ActivationSettings(policy="keep", loss_chunk_tokens=1024, read_ahead=2, min_bytes=64 * 1024)


def test_resolved_and_round_trips_through_the_translated_block():
    s = settings(policy="nvme", loss_chunk_tokens=0, read_ahead=4)
    assert s.activations.policy == "nvme" and s.activations.loss_chunk_tokens == 0 and s.activations.read_ahead == 4
    assert C.SwapSettings.from_block(s.block()) == s


def test_every_problem_at_once_with_the_nested_names():
    with pytest.raises(ConfigError) as e:
        settings(policy="auto", read_ahead=-1, loss_chunk_tokens=-5, spill=True)
    text = "\n".join(e.value.problems)
    assert len(e.value.problems) == 4
    assert "aidaptiv.activations.policy" in text and "not implemented yet: choose keep, recompute or nvme" in text
    assert "aidaptiv.activations.read_ahead" in text and "aidaptiv.activations.loss_chunk_tokens" in text
    assert "aidaptiv.activations.spill: unknown setting (known: loss_chunk_tokens, min_bytes, policy, read_ahead)" \
        in text
    with pytest.raises(ConfigError, match="aidaptiv.activations.policy"):
        settings(policy="offload")
