"""The training job's plumbing without DeepSpeed: environment, exit codes, failure reports."""

import json
import os

import pytest
import torch

from aidaptiv_ds import cli
from aidaptiv_ds.engine import disk
from aidaptiv_ds.job import checkpoints, rank_env, train
from aidaptiv_ds.job import failures as job_args
from aidaptiv_ds.job.settings import TrainSettings


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def test_single_process_env_is_filled_in(clean_env):
    rank_env.ensure_single_process_env()
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("0", "0", "1")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and 1024 <= int(os.environ["MASTER_PORT"]) < 65536


def test_launcher_env_is_kept(clean_env, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    rank_env.ensure_single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("1", "2", "29500")


def test_resume_path_resolution(tmp_path):
    (tmp_path / "latest").write_text("step4")
    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert checkpoints.resolve_resume(str(tmp_path)) == (str(tmp_path), None)
    assert checkpoints.resolve_resume(str(tmp_path / "step4")) == (str(tmp_path), "step4")
    (tmp_path / "empty").mkdir()
    with pytest.raises(job_args.TrainingFailed, match="no DeepSpeed checkpoint"):
        checkpoints.resolve_resume(str(tmp_path / "empty"))
    with pytest.raises(job_args.TrainingFailed, match="does not exist"):
        checkpoints.resolve_resume(str(tmp_path / "missing"))


def run_cli(argv):
    return cli.main(["train", *argv])


def test_malformed_data_is_one_clear_line_and_exit_1(clean_env, tmp_path, capsys, repo):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n{"prompt": 1}\n')
    out = tmp_path / "m.json"
    rc = run_cli(
        [
            "--config",
            os.path.join(repo, "ds_configs", "zero3.json"),
            "--model",
            "micro",
            "--data",
            str(data),
            "--metrics-out",
            str(out),
        ]
    )
    assert rc == 1
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err + printed.out
    assert f"{data}:2" in printed.out
    m = json.loads(out.read_text())
    assert m["status"] == "error" and f"{data}:2" in m["error"] and m["losses"] is None


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (MemoryError(), "oom", 3),
        (torch.OutOfMemoryError("CUDA out of memory.\nTried to allocate 2.00 GiB"), "oom", 3),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory"), "oom", 3),
        (AssertionError("Not enough buffers 0 for swapping 1"), "error", 1),
    ],
)
def test_failures_during_training_map_to_status_and_exit_code(
    clean_env, tmp_path, monkeypatch, capsys, repo, exc, status, code
):
    closed = []
    monkeypatch.setattr(train.Run, "build", lambda self: None)
    monkeypatch.setattr(train.Run, "close", lambda self: closed.append(True))

    def fail(self):
        raise exc

    monkeypatch.setattr(train.Run, "train", fail)
    out = tmp_path / "m.json"
    rc = run_cli(
        [
            "--config",
            os.path.join(repo, "ds_configs", "zero3.json"),
            "--model",
            "micro",
            "--metrics-out",
            str(out),
            "--seq-len",
            "32",
        ]
    )
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


def test_every_input_and_destination_is_refused_before_deepspeed_starts(clean_env, tmp_path, repo, capsys, monkeypatch):
    """What once failed only after every step (an --output-dir that cannot be written: a bare OSError at the end)
    or mid-run (--micro-batch 0: KeyError 'train_batch_size'; --grad-accum 0: ZeroDivisionError) or not at all
    (--lr nan ran and said status=ok), with a --save-dir through a file, a missing --resume-from and --data and a
    swap folder in memory: all said at once, one sentence each, as flags, before DeepSpeed starts or a byte is
    written."""
    built = []
    monkeypatch.setattr(train.Run, "build", lambda self: built.append(True))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = tmp_path / "m.json"
    argv = [
        "--config",
        os.path.join(repo, "ds_configs", "aidaptiv.json"),
        "--model",
        "micro",
        "--metrics-out",
        str(out),
        "--micro-batch",
        "0",
        "--grad-accum",
        "0",
        "--lr",
        "nan",
        "--output-dir",
        str(blocker),
        "--save-dir",
        str(blocker / "ckpt"),
        "--resume-from",
        str(tmp_path / "no-such-run"),
        "--data",
        str(tmp_path / "no-such-data.jsonl"),
    ]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and disk.mount_of("/dev/shm")["fstype"] == "tmpfs" else None
    if shm:
        argv += ["--nvme-path", shm]
    assert run_cli(argv) == 1 and built == []
    error = json.loads(out.read_text())["error"]
    said = [
        "--micro-batch 0 must be at least 1",
        "--grad-accum 0 must be at least 1",
        "--lr nan must be a finite number",
        f"--output-dir {blocker} is a file, not a folder",
        f"--save-dir {blocker}/ckpt cannot be made because {blocker} is a file",
        f"--resume-from {tmp_path}/no-such-run does not exist",
        f"--data: data file {tmp_path}/no-such-data.jsonl does not exist",
    ] + ([f"--nvme-path {shm} is on tmpfs (memory, not a disk"] if shm else [])
    assert all(s in error for s in said) and error.count("; ") == len(said) - 1, error
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["a-file", "m.json"]


def test_a_config_whose_numbers_deepspeed_fails_on_mid_run_is_refused(clean_env, tmp_path, repo, monkeypatch):
    """The same numbers in the config itself (a micro-batch of 0, an lr of NaN) are the config check's."""
    built = []
    monkeypatch.setattr(train.Run, "build", lambda self: built.append(True))
    cfg = json.load(open(os.path.join(repo, "ds_configs", "zero3.json")))
    cfg["train_micro_batch_size_per_gpu"] = 0
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"]["lr"] = float("nan")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))  # Python's json writes NaN, and reads it back
    out = tmp_path / "m.json"
    assert run_cli(["--config", str(path), "--model", "micro", "--metrics-out", str(out)]) == 1 and built == []
    error = json.loads(out.read_text())["error"]
    assert "train_micro_batch_size_per_gpu 0 must be a whole number of at least 1" in error, error
    assert "optimizer.params.lr nan must be a finite number" in error, error


def test_aidaptiv_block_without_initialize_is_a_clear_error(monkeypatch):
    import aidaptiv_ds

    monkeypatch.delattr(aidaptiv_ds, "initialize", raising=False)
    with pytest.raises(job_args.TrainingFailed, match='"aidaptiv" block but this aidaptiv_ds has no initialize'):
        train._aidaptiv_api()


def test_aidaptiv_api_is_used_when_present(monkeypatch):
    import aidaptiv_ds

    init, zinit = object(), object()
    monkeypatch.setattr(aidaptiv_ds, "initialize", init, raising=False)
    monkeypatch.setattr(aidaptiv_ds, "zero_init", zinit, raising=False)
    assert train._aidaptiv_api() == (init, zinit)


def test_create_nvme_path_makes_a_private_folder_on_this_node(tmp_path):
    path = tmp_path / "swap-root" / "cell.123"  # the parent is missing too on a fresh node
    old = os.umask(0o022)
    try:
        assert rank_env.make_nvme_path(str(path)) is True
    finally:
        os.umask(old)
    assert path.is_dir() and (path.stat().st_mode & 0o777) == 0o700
    assert rank_env.make_nvme_path(str(path)) is False  # another rank of this node made it first: kept as it is


def _prepare(tmp_path, *extra):
    args = cli.parse_args(
        [
            "train",
            "--config",
            os.path.join(os.path.dirname(__file__), "..", "..", "ds_configs", "aidaptiv.json"),
            "--model",
            "micro",
            "--seq-len",
            "16",
            "--steps",
            "1",
            *extra,
        ]
    )
    job = train.Run(TrainSettings.from_namespace(args))
    job.prepare()
    return job


def test_a_rank_whose_node_lacks_the_swap_folder_makes_it_when_told(clean_env, tmp_path):
    from aidaptiv_ds.config import ds_config
    from aidaptiv_ds.config import resolve as config

    swap = tmp_path / "node-local" / "cell.7"
    # The sweep made the folder on the first node only: without --create-nvme-path the job refuses it before
    # DeepSpeed starts (as deepspeed.initialize's own check, config.validate, would), and makes nothing.
    with pytest.raises(job_args.TrainingFailed, match=f"`nvme_path` {swap} does not exist"):
        _prepare(tmp_path, "--nvme-path", str(swap))
    assert not (tmp_path / "node-local").exists()
    with pytest.raises(ds_config.ConfigError, match="does not exist"):
        config.validate({"zero_optimization": {"stage": 3}, "aidaptiv": {"enabled": True, "nvme_path": str(swap)}})
    job = _prepare(tmp_path, "--nvme-path", str(swap), "--create-nvme-path")
    assert swap.is_dir() and (swap.stat().st_mode & 0o777) == 0o700
    assert job.info["nvme_paths"] == [str(swap)] and job.info["nvme_path_created"] is True
    assert config.validate(job.cfg).nvme_path == str(swap)


def test_create_nvme_path_needs_nvme_path(clean_env, tmp_path):
    with pytest.raises(job_args.TrainingFailed, match="`create_nvme_path` needs `nvme_path`"):
        _prepare(tmp_path, "--create-nvme-path")
