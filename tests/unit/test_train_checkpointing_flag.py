"""How `train --gradient-checkpointing` meets an "aidaptiv" block's activation policy (run_config.checkpointing_in_block):
no policy becomes "recompute", "recompute" and "nvme" already checkpoint, an explicit "keep" is refused with
what to do, and a config without the block is left to build(), which checkpoints the model itself."""

import pytest

from aidaptiv_ds.job.failures import TrainingFailed
from aidaptiv_ds.job.run_config import checkpointing_in_block


def config(activations=None, enabled=True):
    block = {"enabled": enabled, "nvme_path": "."}
    if activations is not None:
        block["activations"] = activations
    return {"zero_optimization": {"stage": 3}, "aidaptiv": block}


def test_no_policy_becomes_recompute_without_touching_the_callers_config():
    cfg = config({"loss_chunk_tokens": 256})
    out, applied = checkpointing_in_block(cfg)
    assert out["aidaptiv"]["activations"] == {"loss_chunk_tokens": 256, "policy": "recompute"}
    assert cfg["aidaptiv"]["activations"] == {"loss_chunk_tokens": 256}
    assert applied == "aidaptiv.activations.policy recompute"
    assert checkpointing_in_block(config())[0]["aidaptiv"]["activations"] == {"policy": "recompute"}


@pytest.mark.parametrize("policy", ["recompute", "nvme"])
def test_policies_that_checkpoint_already_are_kept(policy):
    cfg = config({"policy": policy})
    assert checkpointing_in_block(cfg) == (cfg, f"aidaptiv.activations.policy {policy}")


def test_an_explicit_keep_is_refused_with_what_to_do():
    with pytest.raises(TrainingFailed, match='policy is "keep": drop it, or set the policy to "recompute"'):
        checkpointing_in_block(config({"policy": "keep"}))


def test_without_an_enabled_block_the_config_is_unchanged():
    for cfg in ({"zero_optimization": {"stage": 3}}, config({"policy": "keep"}, enabled=False)):
        out, applied = checkpointing_in_block(cfg)
        assert out is cfg and applied is None
