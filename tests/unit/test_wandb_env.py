"""W&B's environment for a run with the config's "wandb" section on (aidaptiv_ds.job.wandb_env)."""

import importlib.util

import pytest

from aidaptiv_ds.job import wandb_env

ON = {"wandb": {"enabled": True, "project": "p"}}


def test_off_sets_nothing(tmp_path):
    env = {}
    assert wandb_env.prepare({"wandb": {"enabled": False}}, str(tmp_path), env) == {}
    assert wandb_env.prepare({}, str(tmp_path), env) == {} and env == {}


def test_on_is_offline_in_the_run_folder(tmp_path):
    env = {}
    run = tmp_path / "run"
    assert wandb_env.prepare(ON, str(run), env) == {"mode": "offline", "dir": str(run)}
    assert env == {"WANDB_MODE": "offline", "WANDB_DIR": str(run)} and run.is_dir()


def test_the_users_settings_win(tmp_path):
    env = {"WANDB_MODE": "online", "WANDB_DIR": str(tmp_path / "mine")}
    assert wandb_env.prepare(ON, str(tmp_path / "run"), env) == {"mode": "online", "dir": str(tmp_path / "mine")}
    assert not (tmp_path / "run").exists()


def test_missing_package_is_named_before_deepspeed_starts(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"wandb package is not installed: pip install 'aidaptiv-ds\[tracking\]'"):
        wandb_env.prepare(ON, str(tmp_path), {})
