"""The training job's plumbing without DeepSpeed: environment, exit codes, failure reports."""
import json
import os

import pytest
import torch

from aidaptiv_ds import cli, train


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def test_single_process_env_is_filled_in(clean_env):
    train.ensure_single_process_env()
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("0", "0", "1")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and 1024 <= int(os.environ["MASTER_PORT"]) < 65536


def test_launcher_env_is_kept(clean_env, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    train.ensure_single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("1", "2", "29500")


def test_resume_path_resolution(tmp_path):
    (tmp_path / "latest").write_text("step4")
    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert train._resolve_resume(str(tmp_path)) == (str(tmp_path), None)
    assert train._resolve_resume(str(tmp_path / "step4")) == (str(tmp_path), "step4")
    (tmp_path / "empty").mkdir()
    with pytest.raises(train.TrainingFailed, match="no DeepSpeed checkpoint"):
        train._resolve_resume(str(tmp_path / "empty"))
    with pytest.raises(train.TrainingFailed, match="does not exist"):
        train._resolve_resume(str(tmp_path / "missing"))


def run_cli(argv):
    return cli.main(["train", *argv])


def test_malformed_data_is_one_clear_line_and_exit_1(clean_env, tmp_path, capsys, repo):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n{"prompt": 1}\n')
    out = tmp_path / "m.json"
    rc = run_cli(["--config", os.path.join(repo, "ds_configs", "zero3.json"), "--model", "micro",
                  "--data", str(data), "--metrics-out", str(out)])
    assert rc == 1
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err + printed.out
    assert f"{data}:2" in printed.out
    m = json.loads(out.read_text())
    assert m["status"] == "error" and f"{data}:2" in m["error"] and m["losses"] is None


@pytest.mark.parametrize("exc, status, code", [
    (MemoryError(), "oom", 3),
    (torch.OutOfMemoryError("CUDA out of memory.\nTried to allocate 2.00 GiB"), "oom", 3),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory"), "oom", 3),
    (AssertionError("Not enough buffers 0 for swapping 1"), "error", 1),
])
def test_failures_during_training_map_to_status_and_exit_code(clean_env, tmp_path, monkeypatch, capsys, repo,
                                                              exc, status, code):
    closed = []
    monkeypatch.setattr(train.Run, "build", lambda self: None)
    monkeypatch.setattr(train.Run, "close", lambda self: closed.append(True))

    def fail(self):
        raise exc
    monkeypatch.setattr(train.Run, "train", fail)
    out = tmp_path / "m.json"
    rc = run_cli(["--config", os.path.join(repo, "ds_configs", "zero3.json"), "--model", "micro",
                  "--metrics-out", str(out), "--seq-len", "32"])
    assert rc == code and closed == [True]
    m = json.loads(out.read_text())
    assert m["status"] == status and m["model"] == "micro" and m["backend"] == "zero3"
    assert m["error"].startswith(type(exc).__name__)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("aidaptiv-ds train: status=" + status)
    if code == 3 and "Tried" in str(exc):
        assert "Tried to allocate 2.00 GiB" in m["error"], "the error's last line is kept"


def test_bad_arguments_exit_1(clean_env, tmp_path, repo, capsys):
    assert run_cli(["--config", os.path.join(repo, "ds_configs", "zero3.json"), "--steps", "0"]) == 1
    assert "--steps 0 must be at least 1" in capsys.readouterr().out
    assert run_cli(["--config", str(tmp_path / "none.json")]) == 1


def test_aidaptiv_block_without_initialize_is_a_clear_error(monkeypatch):
    import aidaptiv_ds
    monkeypatch.delattr(aidaptiv_ds, "initialize", raising=False)
    with pytest.raises(train.TrainingFailed, match='"aidaptiv" block but this aidaptiv_ds has no initialize'):
        train._aidaptiv_api()


def test_aidaptiv_api_is_used_when_present(monkeypatch):
    import aidaptiv_ds
    init, zinit = object(), object()
    monkeypatch.setattr(aidaptiv_ds, "initialize", init, raising=False)
    monkeypatch.setattr(aidaptiv_ds, "zero_init", zinit, raising=False)
    assert train._aidaptiv_api() == (init, zinit)
