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


def test_the_precision_of_a_run_and_why(monkeypatch):
    """A run says which precision it trains in and why; auto takes the model's own where the machine computes
    it natively (here: a CPU with and without AVX512-BF16), and a preset has no precision of its own."""
    import types

    from aidaptiv_ds.engine import machine
    from aidaptiv_ds.job.run_config import choose_precision

    bf16_model, preset = types.SimpleNamespace(dtype="bfloat16"), types.SimpleNamespace()
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx512f", "avx512_bf16"])
    assert choose_precision("auto", "fp32", bf16_model, cuda=False)[0] == "bf16"
    assert choose_precision("fp32", "bf16", bf16_model, cuda=False) == ("fp32", "`dtype` fp32")
    assert choose_precision("auto", "fp32", preset, cuda=False)[0] == "fp32"
    kept, why = choose_precision(None, "fp32", bf16_model, cuda=False)
    assert kept == "fp32" and "the model ships in bf16: `dtype` bf16 (or auto)" in why and "natively" in why
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx2"])
    assert choose_precision("auto", "fp32", bf16_model, cuda=False) == (
        "fp32",
        "`dtype` auto: fp32, since this machine has no native bf16 (the model ships in it)",
    )
    assert "emulated here" in choose_precision(None, "fp32", bf16_model, cuda=False)[1]
