"""The fake_env fixture: environment and ds_configs folder for sweeps that launch the fake trainer."""

import os

import pytest
from sweep_fakes import DEEPSPEED, FAKES, ROOT


@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    """Environment and ds_configs folder for sweeps that launch the fake trainer; returns the configs dir."""
    if not os.access(DEEPSPEED, os.X_OK):
        pytest.skip(f"no deepspeed launcher at {DEEPSPEED}")
    monkeypatch.setenv("PYTHONPATH", FAKES + os.pathsep + ROOT)
    monkeypatch.setenv("AIDAPTIV_DS_TRAIN_MODULE", "fake_train")
    monkeypatch.setenv("FAKE_STEP_S", "0.01")
    monkeypatch.delenv("FAKE_TRAIN_PLAN", raising=False)
    configs = tmp_path / "ds_configs"
    configs.mkdir()
    for b in ("zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv"):
        (configs / f"{b}.json").write_text("{}\n")
    return str(configs)
