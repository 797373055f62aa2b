"""Each shipped baseline config launches as it is on the micro preset and reports sane metrics."""

import json
import math
import os
import statistics

import pytest
from helpers import CONFIGS, read_metrics, run_train

from aidaptiv_ds.models.presets import count_parameters, preset_config

SHIPPED = ("zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv")
STEPS, WARMUP, SEQ, MB = 3, 1, 64, 2
MICRO_PARAMS = count_parameters(preset_config("micro"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One short run per config, from a fresh working directory (so relative nvme_paths land there)."""
    out = {}
    for name in SHIPPED:
        cwd = tmp_path_factory.mktemp(name)
        metrics = cwd / "metrics.json"
        rc, log = run_train(
            [
                "--config",
                os.path.join(CONFIGS, f"{name}.json"),
                "--model",
                "micro",
                "--steps",
                str(STEPS),
                "--warmup",
                str(WARMUP),
                "--seq-len",
                str(SEQ),
                "--metrics-out",
                str(metrics),
            ],
            cwd=cwd,
        )
        out[name] = (rc, log, cwd, metrics)
    return out


@pytest.mark.parametrize("name", SHIPPED)
def test_config_runs_and_reports_sane_metrics(runs, name):
    rc, log, cwd, path = runs[name]
    assert rc == 0, log[-3000:]
    m = read_metrics(path)
    assert m["status"] == "ok" and m["backend"] == name
    assert (m["model"], m["params"], m["micro_batch"], m["seq_len"], m["grad_accum"], m["world_size"]) == (
        "micro",
        MICRO_PARAMS,
        MB,
        SEQ,
        1,
        1,
    )
    assert m["steps"] == STEPS and m["warmup"] == WARMUP and len(m["step_s"]) == STEPS
    assert len(m["losses"]) == STEPS and all(math.isfinite(x) for x in m["losses"])
    # Random weights over a 2048-id vocabulary start near ln(2048) = 7.6.
    assert 6.5 < m["losses"][0] < 9.0
    assert m["tokens_per_s"] > 0 and m["step_s_median"] > 0
    assert m["tokens_per_s"] == pytest.approx(MB * SEQ / m["step_s_median"])
    assert m["step_s_median"] == pytest.approx(statistics.median(m["step_s"][WARMUP:]))
    assert all(m["phases_s"][p] >= 0 for p in ("forward", "backward", "optimizer"))
    assert sum(m["phases_s"][p] for p in ("forward", "backward", "optimizer")) <= m["step_s_median"] * 1.5
    if name == "aidaptiv":  # our swapper reports where its time went and what it pinned
        assert m["phases_s"]["io_wait"] >= 0 and m["peak_pinned_mb"] > 0
    else:
        assert m["phases_s"]["io_wait"] is None and m["peak_pinned_mb"] is None, "no engine stats: must be null"
    assert m["peak_gpu_mb"] is None
    assert 100 < m["peak_rss_mb"] < 16000
    # The summary line is printed too.
    assert "aidaptiv-ds train: status=ok model=micro backend=" + name in log


def test_zero_infinity_moves_bytes_through_nvme(runs):
    rc, log, cwd, path = runs["zero_infinity"]
    assert rc == 0, log[-3000:]
    m = read_metrics(path)
    timed = STEPS - WARMUP
    assert m["nvme_bytes_steps"] == timed
    state = MICRO_PARAMS * 4
    # Per step at least the fp32 master weights and both Adam moments come in from NVMe and go back out.
    assert m["nvme_read_bytes"] >= 3 * state * timed
    assert m["nvme_write_bytes"] >= 3 * state * timed
    # The relative default nvme_path resolved against the working directory, and the rank's swap files are
    # removed at exit (without --keep-swap) and reported.
    base = cwd / "swap" / "zero_infinity" / "zero_stage_3"
    assert base.is_dir() and not list(base.glob("*/rank0"))
    assert sorted(os.path.relpath(d, base) for d in m["swap_removed"]) == ["float32params/rank0", "optimizer/rank0"]
    assert "removed DeepSpeed swap files" in log


def test_in_memory_configs_do_not_swap(runs):
    for name in ("zero3", "zero3_cpu_offload"):
        m = read_metrics(runs[name][3])
        assert m["nvme_read_bytes"] < 4 * 2**20, name
        assert not (runs[name][2] / "swap").exists()


def test_all_baselines_follow_the_same_loss_trajectory(runs):
    """Same seed, data and maths: the three placements of the state must train identically."""
    losses = {name: read_metrics(runs[name][3])["losses"] for name in SHIPPED}
    for name in SHIPPED[1:]:
        assert losses[name] == pytest.approx(losses["zero3"], rel=1e-4), name


def test_zero_infinity_without_max_in_cpu_0_reads_less(tmp_path, runs):
    """DeepSpeed's default max_in_cpu (1e9) keeps a copy of every parameter in RAM, so forward and backward
    never read parameters from NVMe; the shipped file sets 0. This shows the difference is real."""
    with open(os.path.join(CONFIGS, "zero_infinity.json")) as f:
        cfg = json.load(f)
    del cfg["zero_optimization"]["offload_param"]["max_in_cpu"]
    config = tmp_path / "zi_default_max_in_cpu.json"
    config.write_text(json.dumps(cfg))
    metrics = tmp_path / "m.json"
    rc, log = run_train(
        [
            "--config",
            str(config),
            "--model",
            "micro",
            "--steps",
            str(STEPS),
            "--warmup",
            str(WARMUP),
            "--seq-len",
            str(SEQ),
            "--metrics-out",
            str(metrics),
            "--keep-swap",
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    swap = tmp_path / "swap" / "zero_infinity" / "zero_stage_3"
    assert read_metrics(metrics)["swap_kept"] and (swap / "optimizer" / "rank0").is_dir()
    assert any((swap / "optimizer" / "rank0").iterdir())
    shipped = read_metrics(runs["zero_infinity"][3])
    default = read_metrics(metrics)
    assert default["losses"] == pytest.approx(shipped["losses"], rel=1e-5)
    per_step_saving = (shipped["nvme_read_bytes"] - default["nvme_read_bytes"]) / (STEPS - WARMUP)
    assert per_step_saving >= 0.5 * MICRO_PARAMS * 4, (shipped["nvme_read_bytes"], default["nvme_read_bytes"])


def test_bf16_on_cpu(tmp_path, runs):
    metrics = tmp_path / "m.json"
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "zero3.json"),
            "--model",
            "micro",
            "--steps",
            str(STEPS),
            "--warmup",
            str(WARMUP),
            "--seq-len",
            str(SEQ),
            "--dtype",
            "bf16",
            "--metrics-out",
            str(metrics),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    m = read_metrics(metrics)
    assert m["status"] == "ok" and m["dtype"] == "bf16"
    fp32 = read_metrics(runs["zero3"][3])["losses"]
    assert m["losses"] == pytest.approx(fp32, rel=2e-2) and m["losses"] != pytest.approx(fp32, rel=1e-6)
