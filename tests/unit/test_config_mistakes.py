"""Config mistakes a new user made on the documented paths: a block switched off is reported as the stock
ZeRO-3 it runs, a misspelt block is named instead of silently training without aidaptiv, and the train job
lists every problem of a block, not the last one."""

from __future__ import annotations

import json

import pytest

from aidaptiv_ds import cli
from aidaptiv_ds.config import ds_config
from aidaptiv_ds.config.ds_config import ConfigError
from aidaptiv_ds.config.resolve import validate

BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def test_a_block_switched_off_is_the_stock_zero3_it_runs(tmp_path):
    assert ds_config.backend({**BASE, "aidaptiv": {"enabled": False, "nvme_path": str(tmp_path)}}) == "zero3"
    assert ds_config.backend({**BASE, "aidaptiv": {"enabled": True, "nvme_path": str(tmp_path)}}) == "aidaptiv"


@pytest.mark.parametrize("key", ["aidaptive", "AIDAPTIV_DS", "aidaptv", "aiDaptiv"])
def test_a_misspelt_block_is_named(key, tmp_path):
    cfg = {**BASE, key: {"enabled": True, "nvme_path": str(tmp_path)}}
    (problem,) = ds_config.lookalike_blocks(cfg)
    assert f'top-level "{key}" but no "aidaptiv"' in problem and 'rename it to "aidaptiv"' in problem
    with pytest.raises(ConfigError, match="rename it"):
        validate(cfg)


def test_deepspeed_keys_are_not_taken_for_a_misspelt_block():
    cfg = {
        **BASE,
        "optimizer": {},
        "scheduler": {},
        "bf16": {},
        "train_batch_size": 2,
        "activation_checkpointing": {},
        "aio": {},
        "data_types": {},
        "steps_per_print": 1,
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": False,
    }
    assert ds_config.lookalike_blocks(cfg) == [] and validate(cfg) is None


def test_train_lists_every_problem_of_the_block(clean_env, tmp_path, capsys):
    cfg = tmp_path / "bad.json"
    block = {"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "lots", "layer_group_size": 0}
    cfg.write_text(json.dumps({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "aidaptiv": block}))
    assert cli.main(["train", "--config", str(cfg), "--model", "micro", "--seq-len", "32", "--steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "2 problems in the DeepSpeed config" in out
    assert "aidaptiv.host_memory_budget" in out and "aidaptiv.layer_group_size" in out
