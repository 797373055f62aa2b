"""`aidaptiv-ds plan`: the command, its errors, the written config, the rates cache, the step-time bound, and the
launch guard of `aidaptiv-ds train`."""

import json
import os

import pytest

from aidaptiv_ds import cli
from aidaptiv_ds.job import failures as job_args
from aidaptiv_ds.job import train
from aidaptiv_ds.planner import memory as M
from aidaptiv_ds.planner import rates as R
from aidaptiv_ds.planner.predict import predict
from aidaptiv_ds.planner.shapes import resolve_shape

# Rates given by hand, so that nothing is probed: an A100-40GB node of the C-DAC paper (seeds/003), roughly.
A100_NODE = [
    "--gpu-mem",
    "40GB",
    "--host-mem",
    "192GB",
    "--nvme-free",
    "1800GB",
    "--nvme-read-bw",
    "6GB/s",
    "--nvme-write-bw",
    "4GB/s",
    "--pcie-bw",
    "12GB/s",
    "--gpu-flops",
    "1.5e14",
    "--cpu-adam",
    "2e9",
    "--cpu-flops",
    "2e12",
    "--framework-mem",
    "3GiB",
    "--gpu-overhead",
    "1GiB",
    "--no-probe",
]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("AIDAPTIV_DS_CACHE_DIR", raising=False)  # the suite-wide cache (conftest) would win


def plan_json(capsys, *argv):
    rc = cli.main(["plan", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_seeds_a100_node_zero3_does_not_fit_aidaptiv_does(capsys):
    rc, out = plan_json(
        capsys,
        "--model",
        "llama2-7b",
        "--seq-len",
        "2048",
        "--micro-batch",
        "8",
        "--activations",
        "recompute",
        *A100_NODE,
    )
    assert rc == 0
    b = out["backends"]
    assert not b["zero3"]["fits"] and "GPU memory" in b["zero3"]["problems"][0]
    assert b["aidaptiv"]["fits"]
    assert b["aidaptiv"]["prediction"]["bound"] in ("compute", "nvme", "pcie", "cpu_adam")
    assert out["parameters"] == 6_738_415_616


SEEDS_003_CELL = ["--model", "llama2-7b", "--seq-len", "2048", "--micro-batch", "32"]
# The A100 node's rates (nothing probed), with the 512 GB of RAM of seeds/003's machine.
SEEDS_003_NODE = [*A100_NODE[:2], "--host-mem", "512GB", *A100_NODE[4:], "--gpus", "1"]


def test_seeds_003_cell_by_default_only_aidaptiv_fits_with_its_own_activation_mode(capsys):
    """seeds/003's cell (Llama-2-7B, sequence 2048, batch 32, one A100-40GB, 512 GB of RAM), which aiDAPTIV+ ran:
    without --activations each backend is planned with the modes it really has. Stock DeepSpeed keeps or
    recomputes, neither fits 40 GB; aidaptiv fits by recomputing (its chunked loss, the block's default), and the
    notes say which mode each backend was planned with."""
    rc, out = plan_json(capsys, *SEEDS_003_CELL, *SEEDS_003_NODE)
    assert rc == 0
    b = out["backends"]
    assert out["job"]["activations"] == "per backend"
    for stock in ("zero3", "zero3_cpu_offload", "zero_infinity"):
        assert not b[stock]["fits"] and "GPU memory" in b[stock]["problems"][0], stock
        assert b[stock]["activations"] == "recompute" and b[stock]["loss_chunk_tokens"] is None
        assert "none of this backend's keep, recompute fits" in b[stock]["notes"][0]
    assert b["aidaptiv"]["fits"]
    assert b["aidaptiv"]["activations"] == "recompute" and b["aidaptiv"]["loss_chunk_tokens"] == 1024
    assert b["aidaptiv"]["notes"][0].startswith("activations: recompute (keep does not fit)")


def test_forcing_nvme_activations_does_not_make_stock_deepspeed_fit(capsys):
    """Stock DeepSpeed cannot store a Hugging Face model's activations on NVMe: forcing the mode refuses it."""
    rc, out = plan_json(capsys, *SEEDS_003_CELL, *SEEDS_003_NODE, "--activations", "nvme")
    b = out["backends"]
    for stock in ("zero3_cpu_offload", "zero_infinity"):
        assert not b[stock]["fits"]
        assert any("has no such mode" in p for p in b[stock]["problems"]), b[stock]["problems"]
    assert b["aidaptiv"]["fits"] and b["aidaptiv"]["activations"] == "nvme"


def test_table_names_the_bound_and_the_problem(capsys):
    rc = cli.main(
        ["plan", "--model", "llama2-70b", "--seq-len", "256", "--micro-batch", "1", "--backend", "zero3", *A100_NODE]
    )
    text = capsys.readouterr().out
    assert rc == 3  # nothing planned fits
    assert "zero3" in text and "NO" in text and "does not fit: GPU memory" in text
    assert "bound" in text


def test_more_gpus_scale_tokens_per_second(capsys):
    args = [
        "--model",
        "llama2-7b",
        "--seq-len",
        "512",
        "--micro-batch",
        "4",
        "--backend",
        "aidaptiv",
        "--activations",
        "recompute",
        *A100_NODE,
    ]
    _, one = plan_json(capsys, *args)
    _, two = plan_json(capsys, *args, "--gpus", "2")
    p1, p2 = one["backends"]["aidaptiv"]["prediction"], two["backends"]["aidaptiv"]["prediction"]
    assert p2["tokens_per_s"] > p1["tokens_per_s"]
    assert (
        two["backends"]["aidaptiv"]["totals"]["nvme_per_node"]
        <= one["backends"]["aidaptiv"]["totals"]["nvme_per_node"] * 1.01
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model", "gpt-5", "--seq-len", "8", "--micro-batch", "1"], "is not a preset, a local Hugging Face folder"),
        (["--model", "tiny", "--seq-len", "8", "--micro-batch", "1", "--backend", "zero2"], "expected all or"),
    ],
)
def test_impossible_inputs_say_what_is_accepted(capsys, argv, expected):
    assert cli.main(["plan", *argv, "--no-probe"]) == 1
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, expected",
    [("--host-mem", "lots", "KiB/MiB/GiB"), ("--seq-len", "0", "at least 1"), ("--nvme-read-bw", "fast", "per second")],
)
def test_bad_sizes_are_usage_errors(capsys, flag, value, expected):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--model", "tiny", "--seq-len", "8", "--micro-batch", "1", flag, value])
    assert e.value.code == 2
    assert expected in capsys.readouterr().err


def test_written_config_validates_and_launches_as_planned(capsys, tmp_path):
    from aidaptiv_ds.config import resolve as aconfig

    swap = tmp_path / "swap"
    swap.mkdir()
    out = tmp_path / "plan.json"
    rc = cli.main(
        [
            "plan",
            "--model",
            "tiny",
            "--seq-len",
            "64",
            "--micro-batch",
            "2",
            "--dtype",
            "fp32",
            "--host-mem",
            "2GiB",
            "--nvme-path",
            str(swap),
            "--nvme-read-bw",
            "1GB/s",
            "--nvme-write-bw",
            "1GB/s",
            "--cpu-flops",
            "1e11",
            "--cpu-adam",
            "1e8",
            "--framework-mem",
            "1200MiB",
            "--no-probe",
            "--write-config",
            str(out),
        ]
    )
    assert rc == 0
    cfg = json.loads(out.read_text())
    settings = aconfig.validate(cfg)
    assert settings.nvme_path == str(swap)
    assert cfg["aidaptiv"]["host_memory_budget"] <= 2 * 2**30 - 1200 * 2**20
    assert "bf16" not in cfg
    assert "activations" not in cfg["aidaptiv"]  # planned with every activation kept: the default


@pytest.mark.parametrize("mode,policy", [("recompute", "recompute"), ("nvme", "nvme")])
def test_written_config_holds_the_activations_that_were_planned(tmp_path, mode, policy):
    """A plan that counted recomputed or stored activations and a chunked loss writes that policy, so the
    job it launches holds what was planned."""
    from aidaptiv_ds.config import resolve as aconfig

    (tmp_path / "swap").mkdir()
    out = tmp_path / "plan.json"
    rc = cli.main(
        [
            "plan",
            "--model",
            "tiny",
            "--seq-len",
            "4096",
            "--micro-batch",
            "1",
            "--dtype",
            "fp32",
            "--host-mem",
            "8GiB",
            "--nvme-path",
            str(tmp_path / "swap"),
            "--nvme-read-bw",
            "1GB/s",
            "--nvme-write-bw",
            "1GB/s",
            "--cpu-flops",
            "1e11",
            "--cpu-adam",
            "1e8",
            "--framework-mem",
            "1200MiB",
            "--no-probe",
            "--activations",
            mode,
            "--loss-chunk-tokens",
            "512",
            "--write-config",
            str(out),
        ]
    )
    assert rc == 0
    cfg = json.loads(out.read_text())
    assert cfg["aidaptiv"]["activations"] == {"policy": policy, "loss_chunk_tokens": 512}
    assert aconfig.validate(cfg).activations.policy == policy


def test_rates_are_cached_per_device_and_given_ones_win(tmp_path, monkeypatch):
    calls = []

    def fake_nvme(directory, **_):
        calls.append(directory)
        return {"nvme_read": 2e9, "nvme_write": 1e9}

    monkeypatch.setattr(R, "probe_nvme", fake_nvme)
    monkeypatch.setattr(R, "probe_cpu", lambda dtype: {"cpu_flops": 1e11, "cpu_adam": 1e8})
    monkeypatch.setattr(R, "probe_framework", lambda: {"framework_host": 1e9})
    monkeypatch.setattr(R, "probe_launcher", lambda: {"launcher_host": 5e8})
    monkeypatch.setattr(R, "probe_zero3", lambda flops, adam: {"zero3_cpu": 1e8})
    cache = str(tmp_path / "rates.json")
    first = R.machine_rates("bf16", str(tmp_path), cache_file=cache)
    again = R.machine_rates("bf16", str(tmp_path), cache_file=cache, given={"nvme_read": 5e9})
    assert calls == [str(tmp_path)]  # the second call read the cache
    assert first.nvme_read == 2e9 and again.nvme_read == 5e9 and again.source["nvme_read"] == "given"
    assert "cached" in again.source["nvme_write"]
    assert R.disk_key(str(tmp_path)) in json.load(open(cache))
    none = R.machine_rates("fp32", None, probe=False, cache_file=str(tmp_path / "empty.json"))
    assert none.cpu_flops is None  # neither given, cached nor probed: unknown


def test_nvme_probe_measures_through_our_engine(tmp_path):
    pytest.importorskip("aidaptiv_ds.engine._C")
    with open("/proc/self/mounts") as f:
        from aidaptiv_ds.engine.disk import MEMORY_FILESYSTEMS, mount_of

        if mount_of(str(tmp_path), f.read())["fstype"] in MEMORY_FILESYSTEMS:
            pytest.skip("tmp_path is on a memory filesystem (no O_DIRECT)")
    rates = R.probe_nvme(str(tmp_path), nbytes=8 << 20, repeats=1)
    assert rates["nvme_read"] > 0 and rates["nvme_write"] > 0
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_bound_is_the_slowest_resource():
    shape = resolve_shape("llama2-7b")
    hw = M.Hardware(gpus=1, gpu_mem=80 << 30, host_mem=512 << 30)
    job = M.Job(shape, 128, 1, dtype="bf16", activations="recompute")
    plan = M.plan_backend("zero_infinity", job, hw)
    slow_disk = R.Rates(nvme_read=1e8, nvme_write=1e8, gpu_flops=1e15, pcie=1e11, cpu_adam=1e12)
    assert predict(plan, job, hw, slow_disk).bound == "nvme"
    slow_gpu = R.Rates(nvme_read=1e12, nvme_write=1e12, gpu_flops=1e9, pcie=1e11, cpu_adam=1e12)
    p = predict(plan, job, hw, slow_gpu)
    assert p.bound == "compute" and p.tokens_per_s == pytest.approx(128 / p.step_s)
    unknown = predict(plan, job, hw, R.Rates())
    assert unknown.step_s is None and "gpu_flops" in unknown.missing


def test_activation_modes_and_the_chunked_loss():
    """tinyllama at 1 x 2048 in bf16: keeping every activation costs most, layer inputs (recompute) less, the
    nvme policy (inputs in flight only) least; a chunked loss holds one chunk's logits instead of all."""
    shape = resolve_shape("tinyllama-1.1b")
    total = {
        mode: sum(M.activation_bytes(M.Job(shape, 2048, 1, dtype="bf16", activations=mode)).values())
        for mode in M.ACTIVATION_POLICIES
    }
    assert total["keep"] > total["recompute"] > total["nvme"]
    unchunked = M.activation_bytes(M.Job(shape, 2048, 1, dtype="bf16", activations="nvme"))["logits and loss"]
    chunked = M.activation_bytes(M.Job(shape, 2048, 1, dtype="bf16", activations="nvme", loss_chunk_tokens=512))[
        "logits and loss"
    ]
    assert chunked * 4 == unchunked


def test_config_activations_follow_the_aidaptiv_block():
    from aidaptiv_ds.planner.guard import config_activations

    assert config_activations({"zero_optimization": {"stage": 3}}) == ("keep", None)
    block = {"enabled": True, "nvme_path": "/x"}
    assert config_activations({"aidaptiv": block}) == ("nvme", 1024)  # no policy: the train job runs auto
    for policy, mode in (("recompute", "recompute"), ("nvme", "nvme"), ("auto", "nvme")):
        cfg = {"aidaptiv": {**block, "activations": {"policy": policy, "loss_chunk_tokens": 0}}}
        assert config_activations(cfg) == (mode, None), policy
    assert config_activations({"aidaptiv": {**block, "enabled": False, "activations": {"policy": "nvme"}}}) == (
        "keep",
        None,
    )


def test_predicted_oom_follows_the_activation_policy():
    """On a 6 GiB GPU cap tinyllama at 2 x 2048 bf16 does not fit aidaptiv with every activation kept (about 10
    GiB of them), and does with the nvme policy and a chunked loss (the cells gpu_scaled's activation policy is
    for)."""
    from aidaptiv_ds.planner.guard import predicted_oom

    common = dict(
        gpus=1,
        nodes=1,
        micro_batch=2,
        seq_len=2048,
        grad_accum=1,
        dtype="bf16",
        host_mem=100 << 30,
        gpu_mem=6 << 30,
        host_budget=4 << 30,
    )
    assert predicted_oom("tinyllama-1.1b", "aidaptiv", **common) is not None
    assert predicted_oom("tinyllama-1.1b", "aidaptiv", activations="nvme", loss_chunk_tokens=1024, **common) is None


# ------------------------------------------------------------------ the launch guard


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


def test_train_refuses_a_model_the_swap_disk_cannot_hold_before_writing(clean_env, tmp_path, monkeypatch, capsys, repo):
    """The issue's symptom: llama2-70b with the shipped config on a disk with about 100 GB free wrote a 51 GB swap
    file before ENOSPC. Now: refused with the numbers, the model never built, the swap folder untouched."""
    import shutil
    from collections import namedtuple

    swap = tmp_path / "swap"
    swap.mkdir()
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda p: usage(200 * 10**9, 100 * 10**9, 100 * 10**9) if str(p).startswith(str(tmp_path)) else real(p),
    )
    built = []
    monkeypatch.setattr(train.Run, "build", lambda self: built.append(True))
    out = tmp_path / "m.json"
    rc = cli.main(
        [
            "train",
            "--config",
            os.path.join(repo, "ds_configs", "aidaptiv.json"),
            "--model",
            "llama2-70b",
            "--nvme-path",
            str(swap),
            "--host-budget",
            "4GiB",
            "--steps",
            "1",
            "--metrics-out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 3 and not built  # 3: does not fit (as for an out-of-memory), not 1: an error
    assert os.listdir(swap) == []
    m = json.loads(out.read_text())
    assert m["status"] == "refused"
    printed = capsys.readouterr()
    assert "swap space" in printed.out and "93.1 GiB free" in printed.out and "llama2-70b" in printed.out
    assert (
        "host_memory_budget is 4096.0 MiB (4,294,967,296 bytes) but the run needs at least" in printed.out
    )  # plan_run's message, early


def test_train_refuses_host_memory_the_state_alone_exceeds(clean_env, tmp_path, monkeypatch, capsys, repo):
    monkeypatch.setattr("aidaptiv_ds.engine.machine.total_ram_bytes", lambda: 1 << 30)
    built = []
    monkeypatch.setattr(train.Run, "build", lambda self: built.append(True))
    rc = cli.main(
        [
            "train",
            "--config",
            os.path.join(repo, "ds_configs", "zero3.json"),
            "--model",
            "small",
            "--steps",
            "1",
            "--no-progress",
        ]
    )
    assert rc == 3 and not built
    assert "host memory: zero3 needs at least 7.3 GiB" in capsys.readouterr().out


def test_no_fit_check_starts_what_the_plan_refuses_and_says_so(clean_env, tmp_path, monkeypatch, capsys, repo):
    """bench/capacity_seq_len.py measures where a backend really runs out; the guard would answer with its prediction."""
    monkeypatch.setattr("aidaptiv_ds.engine.machine.total_ram_bytes", lambda: 1 << 30)
    built = []

    def stop(self):
        built.append(self.info.get("fit_check"))
        raise job_args.TrainingFailed("stopped after the guard")

    monkeypatch.setattr(train.Run, "build", stop)
    rc = cli.main(
        [
            "train",
            "--config",
            os.path.join(repo, "ds_configs", "zero3.json"),
            "--model",
            "small",
            "--steps",
            "1",
            "--no-progress",
            "--no-fit-check",
        ]
    )
    assert rc == 1 and built and built[0]["skipped"]
    assert any("zero3 needs at least 7.3 GiB" in p for p in built[0]["problems"])
    assert "warning: --no-fit-check: starting although" in capsys.readouterr().err


def test_train_lets_a_job_that_fits_go_on(clean_env, tmp_path, monkeypatch, repo):
    built = []

    def stop(self):
        built.append(True)
        raise job_args.TrainingFailed("stopped after the guard")

    monkeypatch.setattr(train.Run, "build", stop)
    rc = cli.main(
        [
            "train",
            "--config",
            os.path.join(repo, "ds_configs", "aidaptiv.json"),
            "--model",
            "micro",
            "--nvme-path",
            str(tmp_path),
            "--steps",
            "1",
            "--no-progress",
        ]
    )
    assert rc == 1 and built


def test_launcher_memory_counts_once_per_node():
    """The deepspeed launcher's processes are counted per node, beside the ranks, when the job runs under it."""
    job = M.Job(resolve_shape("tiny"), 64, 2, dtype="fp32")
    base = M.plan_backend("zero3", job, M.Hardware(gpus=2, host_mem=1 << 40))
    need = base.host_bytes * 2
    fits = M.plan_backend("zero3", job, M.Hardware(gpus=2, host_mem=need + (100 << 20)))
    assert fits.fits
    squeezed = M.plan_backend("zero3", job, M.Hardware(gpus=2, host_mem=need + (100 << 20), launcher_host=200 << 20))
    assert not squeezed.fits and "for the launcher" in squeezed.problems[0]
    # aidaptiv chooses its budget from what the launcher leaves
    a = M.plan_backend("aidaptiv", job, M.Hardware(gpus=1, host_mem=2 << 30))
    b = M.plan_backend("aidaptiv", job, M.Hardware(gpus=1, host_mem=2 << 30, launcher_host=1 << 30))
    assert b.settings["host_memory_budget"] < a.settings["host_memory_budget"]


def test_step_transient_on_cpu_only_and_of_the_whole_model():
    job = M.Job(resolve_shape("tiny"), 64, 2, dtype="fp32")
    n = job.shape.num_parameters
    for backend in ("zero3", "zero_infinity"):
        for gpus in (1, 2):  # not partitioned: every rank gathers every layer
            cpu = M.plan_backend(backend, job, M.Hardware(gpus=gpus, host_mem=1 << 40))
            assert [v for k, v in cpu.host_pageable.items() if "transient" in k] == [
                int(M.DS_STEP_TRANSIENT_PER_PARAM * n)
            ]
        gpu = M.plan_backend(backend, job, M.Hardware(gpus=1, host_mem=1 << 40, gpu_mem=80 << 30))
        assert not any("transient" in k for k in {**gpu.host_pageable, **gpu.gpu})


def test_aidaptiv_has_no_heap_transient_with_its_threshold_fixed():
    """aidaptiv fixes glibc's mmap threshold, so freed gradients go back to the system: the 1-rank cells from
    58M to 3.09B parameters peaked within 3% of the plan without a transient, where a per-parameter term predicted
    28.7 GiB for a qwen2.5-3b run that peaked at 7.2 GiB (planner/memory.py)."""
    job = M.Job(resolve_shape("qwen2.5-3b"), 128, 1, dtype="fp32", host_budget=4 << 30)
    plan = M.plan_backend("aidaptiv", job, M.Hardware(gpus=1, host_mem=8 << 30))
    assert not any("transient" in k for k in plan.host_pageable)
    assert plan.host_bytes < 8 << 30


def test_launch_guard_lets_a_3b_model_start_under_8_gib(repo):
    """The guard refused a qwen2.5-3b run that peaked at 7.2 GiB under an 8 GiB cap (it counted aidaptiv's heap
    transient as state that must be live), whatever the heap settings; it refuses what the pool alone cannot."""
    from aidaptiv_ds.planner.guard import launch_problems

    with open(os.path.join(repo, "ds_configs", "aidaptiv.json")) as f:
        cfg = json.load(f)
    cfg["aidaptiv"].update(nvme_path="/tmp/unused", host_memory_budget=4 << 30)
    ask = dict(world_size=1, local_world_size=1, seq_len=128, micro_batch=1, cuda=False, ram_bytes=8 << 30)
    ask["disk_free"] = lambda p: 1 << 40
    shape = resolve_shape("qwen2.5-3b")
    assert launch_problems(shape, cfg, **ask) == []
    cfg["aidaptiv"]["malloc_mmap_threshold"] = 0  # glibc's dynamic threshold
    assert launch_problems(shape, cfg, **ask) == []
    cfg["aidaptiv"]["host_memory_budget"] = 9 << 30  # the pool alone is more than the ranks may use
    assert any(p.startswith("host memory: aidaptiv needs at least") for p in launch_problems(shape, cfg, **ask))


def test_launcher_probe_doubles_one_runner_import(monkeypatch):
    import subprocess as sp

    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return sp.CompletedProcess(cmd, 0, stdout="250000\n", stderr="")

    monkeypatch.setattr(R.subprocess, "run", fake_run)
    assert R.probe_launcher() == {"launcher_host": 2 * 250000 * 1024.0}
    assert "import deepspeed" in seen["cmd"][-1] and "VmHWM" in seen["cmd"][-1]
    monkeypatch.setattr(R.subprocess, "run", lambda cmd, **kw: sp.CompletedProcess(cmd, 1, stdout="", stderr="boom"))
    with pytest.raises(RuntimeError, match="launcher memory probe"):
        R.probe_launcher()


def test_a_probe_started_by_a_big_process_measures_its_own_peak_not_its_parents():
    """ru_maxrss survives fork and exec on Linux: the launcher probe run inside 'aidaptiv-ds plan' (torch loaded)
    reported 1.5 GiB for two processes of about 250 MB each. The probes and the metrics read VmHWM instead."""
    import subprocess as sp
    import sys

    big = bytearray(600 * 2**20)
    big[::4096] = b"\x01" * len(big[::4096])  # resident in this (parent) process
    code = "from aidaptiv_ds.common.metrics import peak_rss_mb; print(peak_rss_mb())"
    out = sp.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert float(out.stdout.split()[-1]) < 300, out.stdout  # the child's own peak, not the parent's 600+ MiB
    del big


def test_plan_counts_the_launcher_for_jobs_of_more_than_one_rank(capsys):
    common = [
        "--model",
        "tiny",
        "--seq-len",
        "64",
        "--micro-batch",
        "2",
        "--dtype",
        "fp32",
        "--backend",
        "zero3",
        "--host-mem",
        "64GiB",
        "--framework-mem",
        "0",
        "--launcher-mem",
        "1GiB",
        "--no-probe",
    ]
    _, one = plan_json(capsys, *common, "--gpus", "1")
    _, two = plan_json(capsys, *common, "--gpus", "2")
    assert one["hardware"]["launcher_host_bytes"] == 0  # 'aidaptiv-ds train' alone needs no launcher
    assert two["hardware"]["launcher_host_bytes"] == 1 << 30


def test_a_sweep_cell_is_predicted_oom_when_the_launcher_leaves_too_little():
    from aidaptiv_ds.planner.guard import predicted_oom

    job = M.Job(resolve_shape("tiny"), 64, 2, dtype="fp32")
    need = M.plan_backend("zero3", job, M.Hardware(gpus=1, host_mem=1 << 40)).host_bytes
    cell = dict(
        gpus=1,
        nodes=1,
        micro_batch=2,
        seq_len=64,
        grad_accum=1,
        dtype="fp32",
        host_mem=need + (100 << 20),
        gpu_mem=None,
        host_budget=None,
    )
    assert predicted_oom("tiny", "zero3", **cell) is None
    assert "launcher" in predicted_oom("tiny", "zero3", **cell, launcher_host=200 << 20)


def test_zero3_probe_is_the_step_less_compute_and_adam(monkeypatch):
    import subprocess as sp

    from aidaptiv_ds.planner.predict import step_flops

    def fake_run(cmd, **kw):
        with open(cmd[cmd.index("--metrics-out") + 1], "w") as f:
            json.dump({"status": "ok", "step_s_median": 1.0}, f)
        assert "zero3" in cmd[cmd.index("--config") + 1] and cmd[cmd.index("--model") + 1] == "tiny"
        return sp.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(R.subprocess, "run", fake_run)
    shape = resolve_shape("tiny")
    compute = step_flops(M.Job(shape, 64, 2, dtype="fp32")) / 1e11
    adam = shape.num_parameters / 1e9
    rate = R.probe_zero3(1e11, 1e9)["zero3_cpu"]
    assert rate == pytest.approx(shape.num_parameters / (1.0 - compute - adam))
    assert R.probe_zero3(1e9, 1e6) == {}  # compute and Adam alone take longer than the step: nothing to add


def test_zero3_work_adds_to_the_cpu_bound_once_per_rank_for_the_whole_model():
    shape = resolve_shape("tiny")
    job = M.Job(shape, 64, 2, dtype="fp32")
    base = R.Rates(cpu_flops=1e11, cpu_adam=1e9)
    with_zero3 = R.Rates(cpu_flops=1e11, cpu_adam=1e9, zero3_cpu=1e8)
    for ranks in (1, 2):
        hw = M.Hardware(gpus=ranks, host_mem=1 << 40)
        plan = M.plan_backend("zero3", job, hw)
        a, b = predict(plan, job, hw, base), predict(plan, job, hw, with_zero3)
        assert a.bound == "cpu (compute + Adam)" and b.bound == "cpu (compute + Adam + ZeRO-3)"
        # every rank gathers the whole model, on its share (1/ranks) of the node's cores
        assert b.step_s - a.step_s == pytest.approx(shape.num_parameters / (1e8 / ranks))


def test_write_config_where_nothing_fits_exits_3_and_writes_nothing(tmp_path, capsys):
    """The help says 3 when nothing fits; --write-config must not turn that into 1 (an error)."""
    (tmp_path / "swap").mkdir()
    out = tmp_path / "plan.json"
    args = [
        "plan",
        "--model",
        "llama2-70b",
        "--seq-len",
        "4096",
        "--micro-batch",
        "1",
        "--dtype",
        "bf16",
        "--host-mem",
        "8GiB",
        "--nvme-path",
        str(tmp_path / "swap"),
        "--nvme-free",
        "10GB",
        "--nvme-read-bw",
        "1GB/s",
        "--nvme-write-bw",
        "1GB/s",
        "--cpu-flops",
        "1e11",
        "--cpu-adam",
        "1e8",
        "--framework-mem",
        "1200MiB",
        "--no-probe",
        "--write-config",
        str(out),
    ]
    assert cli.main(args) == 3
    assert not out.exists() and "aidaptiv does not fit" in capsys.readouterr().err


@pytest.mark.parametrize("model,host", [("llama2-70b", "256GB"), ("llama2-7b", "128GB")])
def test_the_chosen_budget_leaves_the_os_a_reserve(capsys, model, host):
    """70B on 256 GB pinned 237.9 of 238.4 GiB and 7B on 128 GB 117.7 of 119.2 GiB, leaving half a GiB for the
    OS, the page cache, data loading and the user: the chosen budget keeps a tenth of the node free."""
    rc, out = plan_json(
        capsys,
        "--model",
        model,
        "--seq-len",
        "2048",
        "--micro-batch",
        "1",
        "--dtype",
        "bf16",
        "--host-mem",
        host,
        "--gpu-mem",
        "40GB",
        "--nvme-free",
        "4TB",
        "--nvme-read-bw",
        "3GB/s",
        "--nvme-write-bw",
        "2GB/s",
        "--cpu-flops",
        "1e12",
        "--cpu-adam",
        "1e9",
        "--framework-mem",
        "4GiB",
        "--no-probe",
        "--backend",
        "aidaptiv",
        "--activations",
        "recompute",
    )
    plan = out["backends"]["aidaptiv"]
    host_bytes = out["hardware"]["host_mem_bytes"]
    assert plan["fits"], plan["problems"]
    assert plan["totals"]["host_per_node"] <= 0.9 * host_bytes
    assert plan["settings"]["host_memory_budget"] >= 0.5 * host_bytes  # still most of the node


def test_the_reserve_never_refuses_a_job_that_fits(capsys):
    """On a node just large enough, the reserve gives way: the budget is the least the run needs."""
    args = [
        "--model",
        "tiny",
        "--seq-len",
        "64",
        "--micro-batch",
        "1",
        "--dtype",
        "fp32",
        "--nvme-free",
        "100GB",
        "--nvme-read-bw",
        "1GB/s",
        "--nvme-write-bw",
        "1GB/s",
        "--cpu-flops",
        "1e11",
        "--cpu-adam",
        "1e8",
        "--framework-mem",
        "1200MiB",
        "--no-probe",
        "--backend",
        "aidaptiv",
    ]
    _, roomy = plan_json(capsys, *args, "--host-mem", "64GiB")
    need = (
        roomy["backends"]["aidaptiv"]["totals"]["host_per_node"]
        - roomy["backends"]["aidaptiv"]["settings"]["host_memory_budget"]
    )
    least = 1300 << 20  # above tiny's minimum budget, far below the 2 GiB reserve
    rc, tight = plan_json(capsys, *args, "--host-mem", str(need + least))
    plan = tight["backends"]["aidaptiv"]
    assert rc == 0 and plan["fits"], plan["problems"]
    assert any("less than the" in n and "reserve" in n for n in plan["notes"])
