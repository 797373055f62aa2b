import json
import os

import pytest

from aidaptiv_ds.config import ds_config
from aidaptiv_ds.config.ds_config import ConfigError

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ds_configs")
SHIPPED = {"zero3.json": "zero3", "zero3_cpu_offload.json": "zero3_cpu_offload", "zero_infinity.json": "zero_infinity"}


def shipped(name):
    return ds_config.load(os.path.join(CONFIGS, name))


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_are_strict_json_with_the_agreed_defaults(name):
    with open(os.path.join(CONFIGS, name)) as f:
        cfg = json.load(f)
    assert ds_config.backend(cfg) == SHIPPED[name]
    assert list(ds_config._find_auto(cfg)) == []
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 1
    assert "train_batch_size" not in cfg
    assert ds_config.dtype_name(cfg) == "fp32"
    assert cfg["optimizer"]["type"] == "AdamW" and 1e-6 <= cfg["optimizer"]["params"]["lr"] <= 1e-5
    assert cfg["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_pass_deepspeeds_own_validation(name):
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(shipped(name))
    assert parsed.zero_config.stage == 3


def test_zero_infinity_has_the_settings_that_make_it_swap_and_run():
    z = shipped("zero_infinity.json")["zero_optimization"]
    assert z["offload_param"]["device"] == "nvme" and z["offload_optimizer"]["device"] == "nvme"
    assert z["offload_param"]["max_in_cpu"] == 0
    assert z["stage3_max_reuse_distance"] == 0
    # buffer_size must hold the largest partition of the presets the file claims: micro and tiny on 1 rank.
    from aidaptiv_ds.models.presets import largest_parameter_numel, preset_config

    for preset in ("micro", "tiny"):
        assert z["offload_param"]["buffer_size"] >= largest_parameter_numel(preset_config(preset))
    opt = z["offload_optimizer"]
    assert not (opt.get("pipeline_read") or opt.get("pipeline_write")) or opt["buffer_count"] >= 12
    aio = shipped("zero_infinity.json")["aio"]
    assert aio["block_size"] == 2**20, "a block_size over 1 MiB raises DeepSpeed's minimum swappable size"
    assert "thread_count" not in aio, "DeepSpeed 0.19.8 calls it intra_op_parallelism"


def test_overrides_batch_accum_lr_dtype():
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-5}},
    }
    out = ds_config.apply_overrides(cfg, micro_batch=3, grad_accum=2, lr=2e-6, dtype="bf16")
    assert out["train_micro_batch_size_per_gpu"] == 3 and out["gradient_accumulation_steps"] == 2
    assert "train_batch_size" not in out
    assert out["optimizer"]["params"]["lr"] == 2e-6 and out["scheduler"]["params"]["warmup_max_lr"] == 2e-6
    assert out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False
    assert ds_config.dtype_name(out) == "bf16"
    assert cfg["train_batch_size"] == 8 and cfg["optimizer"]["params"]["lr"] == 1e-5, "input must not change"
    untouched = ds_config.apply_overrides(cfg)
    assert untouched == cfg and untouched is not cfg
    with pytest.raises(ConfigError, match="`dtype`"):
        ds_config.apply_overrides(cfg, dtype="fp8")


def test_nvme_path_override_reaches_every_block():
    cfg = shipped("zero_infinity.json")
    cfg["aidaptiv"] = {"enabled": True, "nvme_path": "./swap/aidaptiv", "other": 1}
    out = ds_config.apply_overrides(cfg, nvme_path="/fast/swap")
    z = out["zero_optimization"]
    assert z["offload_param"]["nvme_path"] == z["offload_optimizer"]["nvme_path"] == "/fast/swap"
    assert out["aidaptiv"] == {"enabled": True, "nvme_path": "/fast/swap", "other": 1}
    assert ds_config.backend(out) == "aidaptiv"  # an enabled block; "enabled": false runs stock ZeRO-3
    # A config without any nvme_path gains none.
    assert ds_config.nvme_blocks(ds_config.apply_overrides(shipped("zero3.json"), nvme_path="/x")) == []


def test_backend_names():
    assert ds_config.backend({"zero_optimization": {"stage": 2}}) == "zero2"
    assert (
        ds_config.backend({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
        == "zero_infinity"
    )


def test_check_reports_every_problem_at_once():
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/s", "buffer_size": 1000}},
    }
    with pytest.raises(ConfigError) as e:
        ds_config.check(cfg, world_size=2, largest_param_numel=10_000, model_name="m")
    msg = str(e.value)
    assert "'auto' at train_micro_batch_size_per_gpu" in msg
    assert "fp16 training needs CUDA" in msg
    assert "buffer_size 1000" in msg and "5000 elements with 2 rank(s)" in msg
    ds_config.check(shipped("zero_infinity.json"), world_size=1, largest_param_numel=7_680_000)


def test_batch_sizes_and_lr_deepspeed_fails_on_mid_run_are_refused_at_once():
    """A micro-batch of 0 was a KeyError ('train_batch_size') in the job, an accumulation of 0 a ZeroDivisionError,
    and an lr of NaN or below 0 trained on with status=ok: each is one sentence of the config check."""
    cfg = {
        "train_micro_batch_size_per_gpu": 0,
        "gradient_accumulation_steps": 0,
        "train_batch_size": 2.5,
        "optimizer": {"type": "AdamW", "params": {"lr": float("nan")}},
        "zero_optimization": {"stage": 3},
    }
    with pytest.raises(ConfigError) as e:
        ds_config.check(cfg, world_size=1)
    assert e.value.problems == [
        "train_micro_batch_size_per_gpu 0 must be a whole number of at least 1",
        "gradient_accumulation_steps 0 must be a whole number of at least 1",
        "train_batch_size 2.5 must be a whole number of at least 1",
        "optimizer.params.lr nan must be a finite number, 0 or more (e.g. 1e-5)",
    ]
    for lr in (float("inf"), -1):
        assert ds_config.number_problems({"optimizer": {"params": {"lr": lr}}}) == [
            f"optimizer.params.lr {lr} must be a finite number, 0 or more (e.g. 1e-5)"
        ]
    # What the command line sets it checks itself: those keys are skipped.
    assert ds_config.number_problems(cfg, skip=[*cfg, ds_config.LR_KEY]) == []


def test_buffer_check_fails_for_a_big_preset_on_the_shipped_file():
    from aidaptiv_ds.models.presets import largest_parameter_numel, preset_config

    with pytest.raises(ConfigError, match="raise buffer_size to at least 525336576"):
        ds_config.check(
            shipped("zero_infinity.json"),
            world_size=1,
            largest_param_numel=largest_parameter_numel(preset_config("llama3.1-8b")),
        )


def test_load_hjson_and_errors(tmp_path):
    p = tmp_path / "c.hjson"
    p.write_text("{\n  # comment\n  train_micro_batch_size_per_gpu: 2\n}\n")
    assert ds_config.load(str(p)) == {"train_micro_batch_size_per_gpu": 2}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ds_config.load(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        ds_config.load(str(tmp_path / "nope.json"))
