"""A sweep of real training cells end to end, as users run one: the 1-process cells of bench/grids/cpu_ci.json
(the micro preset, all four backends) through the deepspeed launcher under the grid's 5 GiB host cap, then
the report. The measured comparison (bench/grids/cpu_small.json, 20 cells, about 10 minutes here and several
times that on a slow disk) is a benchmark, not a test: its results are in bench/results/cpu_small/xeon."""

import json
import os

import pytest
from helpers import REPO

from aidaptiv_ds.cli import main as aidaptiv_ds_main
from aidaptiv_ds.common.sizes import state_bytes_per_param


def sweep(argv):
    """`aidaptiv-ds sweep ARGV`, in this process."""
    return aidaptiv_ds_main(["sweep", *argv])


def report(argv):
    """`aidaptiv-ds report ARGV`, in this process."""
    return aidaptiv_ds_main(["report", *argv])


BACKENDS = {"zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv"}


@pytest.fixture(scope="module")
def sweep_out(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cpu_ci") / "out")
    swap = str(tmp_path_factory.mktemp("swap"))
    rc = sweep(
        [
            "--grid",
            os.path.join(REPO, "bench", "grids", "cpu_ci.json"),
            "--gpus",
            "1",
            "--out",
            out,
            "--ds-configs",
            os.path.join(REPO, "ds_configs"),
            "--swap-root",
            swap,
            "--no-progress",
        ]
    )
    assert rc == 0
    assert os.listdir(swap) == []  # every cell's swap folder removed
    return out


def rows(out):
    with open(os.path.join(out, "results.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_every_backend_runs_under_the_cap_and_the_report_is_made(sweep_out):
    got = {r["backend"]: r for r in rows(sweep_out)}
    assert set(got) == BACKENDS
    assert all(r["status"] == "ok" for r in got.values()), {
        b: (r["status"], r["error"]) for b, r in got.items() if r["status"] != "ok"
    }
    for r in got.values():
        assert r["host_mem_cap"]["gb"] == 5 and r["host_mem_cap"]["mechanism"]
        assert r["tokens_per_s"] > 0 and len(r["step_times_s"]) == 4 and r["warmup"] == 1
    assert report([sweep_out, "--no-plots"]) == 0
    text = open(os.path.join(sweep_out, "report.md")).read()
    assert "| ZeRO-Infinity | 1 |" in text and "| aidaptiv | 1 |" in text and "aidaptiv / ZeRO-Infinity" in text


def test_aidaptiv_cell_streams_its_state_through_the_disk(sweep_out):
    """The grid's budget (0.4 of the state) is below the model state, so parameters and optimizer state are
    read back from the swap files every step."""
    row = next(r for r in rows(sweep_out) if r["backend"] == "aidaptiv")
    state = state_bytes_per_param() * row["params"]
    assert 0 < row["aidaptiv_host_budget_bytes"] < state
    assert row["nvme_read_bytes"] > 0 and row["nvme_write_bytes"] > 0


def test_zero_infinity_with_aidaptivs_memory_runs_and_trains_like_zero_infinity(sweep_out, tmp_path):
    """One real zero_infinity_eqmem cell: micro at 0.6 of its state, where the sized config keeps a RAM cache
    of whole sub-groups (max_in_cpu > 0) and swaps the rest; it runs under the cap, holds no more than
    aidaptiv's budget by the sizing, and follows ZeRO-Infinity's losses (same model, data and optimizer)."""
    grid = json.load(open(os.path.join(REPO, "bench", "grids", "cpu_ci.json")))
    grid.update(notes="one eqmem cell", gpus=[1], backends=["zero_infinity_eqmem"], aidaptiv_state_fraction=0.6)
    path = tmp_path / "eqmem.json"
    path.write_text(json.dumps(grid))
    out = str(tmp_path / "out")
    assert (
        sweep(
            [
                "--grid",
                str(path),
                "--out",
                out,
                "--ds-configs",
                os.path.join(REPO, "ds_configs"),
                "--swap-root",
                str(tmp_path / "swap"),
                "--no-progress",
            ]
        )
        == 0
    )
    (row,) = rows(out)
    assert row["status"] == "ok", (row["status"], row["error"])
    eq = row["eqmem"]
    assert 0 < eq["max_in_cpu"] < eq["partition_numel"] and eq["sized_bytes"] <= eq["budget_bytes"]
    cfg = json.load(open(os.path.join(out, row["cell_dir"], "ds_config.json")))
    assert cfg["zero_optimization"]["offload_param"]["max_in_cpu"] == eq["max_in_cpu"]
    assert row["nvme_read_bytes"] > 0  # the uncached sub-groups and the optimizer state still come from disk
    zi = next(r for r in rows(sweep_out) if r["backend"] == "zero_infinity")
    assert row["losses"] == pytest.approx(zi["losses"], rel=1e-5)
