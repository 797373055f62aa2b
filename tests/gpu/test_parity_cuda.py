"""The swapper on CUDA: the loss trajectory of in-memory ZeRO-3 on one GPU, in fp32 and bf16, with the
parameters and optimizer state really streamed through the swap files. Skipped without CUDA.

The host budget (40 MiB) is below the micro preset's model state (94 MiB in fp32), so every step reads and
writes the state through NVMe, and the GPU receives each parameter from a host slot the swapper may reuse.
"""

import os
import subprocess
import sys

import pytest
import torch
from helpers import (
    CONFIGS,
    aidaptiv_config,
    child_env,
    failure_excerpt,
    read_metrics,
    run_train,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

COMMON = ["--model", "micro", "--seq-len", "128", "--micro-batch", "2", "--warmup", "1", "--steps", "8"]
# fp32: the same kernels see the same bytes, so only the order of gradient sums may differ (none expected on
# one GPU). bf16: DeepSpeed's in-memory optimizer and ours both keep fp32 masters; the bf16 parameter copies
# are rounded from the same fp32 values, so the trajectories stay within bf16's resolution.
REL = {"fp32": 1e-5, "bf16": 2e-2}


def _aidaptiv_config(tmp_path, **zero):
    return aidaptiv_config(tmp_path, zero=zero, host_memory_budget="40MiB", layer_group_size=1)


def _train(tmp_path, config, name, dtype):
    out = tmp_path / f"{name}-{dtype}.json"
    rc, log = run_train(["--config", config, *COMMON, "--dtype", dtype, "--metrics-out", str(out)], cwd=tmp_path)
    assert rc == 0, failure_excerpt(log)
    m = read_metrics(out)
    assert m["status"] == "ok" and m["device"] == "cuda", m
    return m


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_swapper_on_cuda_follows_in_memory_zero3(tmp_path, dtype):
    ref = _train(tmp_path, os.path.join(CONFIGS, "zero3.json"), "zero3", dtype)
    ours = _train(tmp_path, _aidaptiv_config(tmp_path), "aidaptiv", dtype)
    print(f"{dtype} zero3    {ref['losses']}\n{dtype} aidaptiv {ours['losses']}")
    assert ours["backend"] == "aidaptiv"
    assert ours["losses"] == pytest.approx(ref["losses"], rel=REL[dtype])
    # The state really streamed: each timed step read more than the parameters from the disk.
    assert ours["nvme_read_bytes"] / ours["nvme_bytes_steps"] > ours["params"] * 2
    assert ours["peak_gpu_mb"] is not None and ours["peak_gpu_mb"] > 0
    assert os.listdir(tmp_path / "swap") == []


def test_persistence_threshold_from_hf_auto_keeps_the_trajectory(tmp_path):
    """HF's "auto" gives stage3_param_persistence_threshold = 10 x hidden. DeepSpeed releases a persistent
    parameter right after queuing its non-blocking copy from our host slot, which our eviction could reuse
    while the copy runs. The block's translation replaces any threshold with 0 (aidaptiv_ds/config/), so
    this must train like in-memory ZeRO-3 whatever the user set."""
    ref = _train(tmp_path, os.path.join(CONFIGS, "zero3.json"), "zero3", "fp32")
    config = _aidaptiv_config(tmp_path, stage3_param_persistence_threshold=10 * 256)
    ours = _train(tmp_path, config, "aidaptiv-persist", "fp32")
    assert ours["losses"] == pytest.approx(ref["losses"], rel=REL["fp32"])


@pytest.mark.parametrize("policy", ["nvme", "auto"])
def test_activation_policies_on_cuda_follow_in_memory_zero3(tmp_path, policy):
    """The activation policies on CUDA, fp32: block inputs stored through the swap space (nvme), or a plan per
    block (auto), and the loss in chunks, on the trajectory of in-memory ZeRO-3 with activations kept."""
    ref = _train(tmp_path, os.path.join(CONFIGS, "zero3.json"), "zero3", "fp32")
    config = aidaptiv_config(
        tmp_path,
        host_memory_budget="40MiB",
        layer_group_size=1,
        activations={"policy": policy, "loss_chunk_tokens": 64},
    )
    ours = _train(tmp_path, config, f"aidaptiv-{policy}", "fp32")
    print(f"{policy} zero3    {ref['losses']}\n{policy} aidaptiv {ours['losses']}")
    assert ours["losses"] == pytest.approx(ref["losses"], rel=REL["fp32"])
    a = ours["activations"]
    if policy == "nvme":
        assert a["bytes_stored"] > 0 and a["bytes_read"] >= a["bytes_stored"]
    else:
        assert a["plan"]["budget_source"].startswith("half of the"), a["plan"]


def test_auto_activation_budget_follows_the_gpu_memory_cap(tmp_path):
    """--gpu-mem-cap-gb emulates a smaller card with the allocator's fraction; the auto policy's budget must be
    half of what is left under that cap, not of the whole device's free memory."""
    config = aidaptiv_config(
        tmp_path,
        host_memory_budget="40MiB",
        layer_group_size=1,
        activations={"policy": "auto", "loss_chunk_tokens": 64},
    )
    out = tmp_path / "capped.json"
    rc, log = run_train(
        ["--config", config, *COMMON, "--dtype", "fp32", "--gpu-mem-cap-gb", "2", "--metrics-out", str(out)],
        cwd=tmp_path,
    )
    assert rc == 0, failure_excerpt(log)
    plan = read_metrics(out)["activations"]["plan"]
    assert "under this process's cap" in plan["budget_source"], plan["budget_source"]
    assert plan["budget_bytes"] <= 1 << 30


def test_engine_errors_are_exceptions_in_a_cuda_training_process(tmp_path):
    """The H100 runs died of SIGSEGV at the swapper's first C++ exception. The swapper no longer throws for a
    full budget (PinnedPool.try_allocate), but the engine's real errors (I/O, bad arguments) still travel as
    C++ exceptions: they must arrive as Python exceptions in a process with CUDA, DeepSpeed and its ops
    loaded, and training must go on after them."""
    out = tmp_path / "m.json"
    cmd = [
        sys.executable,
        os.path.join(os.path.dirname(__file__), "engine_errors_run.py"),
        "train",
        "--config",
        _aidaptiv_config(tmp_path),
        *COMMON,
        "--dtype",
        "fp32",
        "--metrics-out",
        str(out),
    ]
    p = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    probes = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE")]
    assert p.returncode == 0, "\n".join(probes) + "\n" + failure_excerpt(p.stdout)
    assert sum("caught" in ln for ln in probes) == 4, probes
    assert read_metrics(out)["status"] == "ok"
