"""The CUDA paths of the training job: GPU memory reporting and the out-of-memory exit. Skipped without CUDA."""

import os

import pytest
import torch
from helpers import CONFIGS, read_metrics, run_train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_zero3_on_gpu_reports_gpu_memory(tmp_path):
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "zero3.json"),
            "--model",
            "micro",
            "--steps",
            "3",
            "--seq-len",
            "64",
            "--warmup",
            "1",
            "--metrics-out",
            str(tmp_path / "m.json"),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    m = read_metrics(tmp_path / "m.json")
    assert m["status"] == "ok" and m["device"] == "cuda"
    assert m["peak_gpu_mb"] is not None and m["peak_gpu_mb"] > 1


def test_gpu_memory_cap_gives_status_oom_and_exit_3(tmp_path):
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "zero3.json"),
            "--model",
            "tiny",
            "--steps",
            "2",
            "--seq-len",
            "4096",
            "--micro-batch",
            "16",
            "--gpu-mem-cap-gb",
            "0.5",
            "--metrics-out",
            str(tmp_path / "m.json"),
        ],
        cwd=tmp_path,
    )
    assert rc == 3, log[-3000:]
    m = read_metrics(tmp_path / "m.json")
    assert m["status"] == "oom" and "memory" in m["error"].lower()
    assert "Traceback" not in log.splitlines()[-1]
