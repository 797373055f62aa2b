"""The sweep asks the planner first: a cell that cannot fit under the caps is "predicted OOM", and with
--skip-predicted-oom it is recorded without being run."""

import json
import os

from aidaptiv_ds.cli import main as aidaptiv_ds_main


def sweep(argv):
    """`aidaptiv-ds sweep ARGV`, in this process."""
    return aidaptiv_ds_main(["sweep", *argv])


def test_predicted_oom_cell_is_recorded_not_run(tmp_path, monkeypatch, repo):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no cached framework figure: counted as 0
    monkeypatch.delenv("AIDAPTIV_DS_CACHE_DIR", raising=False)  # the suite-wide cache (conftest) would win
    grid = tmp_path / "g.json"
    grid.write_text(
        json.dumps(
            {
                "notes": "test",
                "models": ["small"],
                "micro_batches": [1],
                "seq_lens": [8],
                "gpus": [1],
                "steps": 2,
                "warmup": 1,
                "timeout_s": 60,
                "backends": ["zero3"],
            }
        )
    )
    out = tmp_path / "out"
    rc = sweep(
        [
            "--grid",
            str(grid),
            "--out",
            str(out),
            "--ds-configs",
            os.path.join(repo, "ds_configs"),
            "--host-mem-cap-gb",
            "1",
            "--skip-predicted-oom",
            "--no-progress",
            "--no-prebuild",
            "--accelerator",
            "cpu",
            "--host-mem-cap-mechanism",
            "rss-watchdog",
        ]
    )
    assert rc == 0
    (row,) = [json.loads(line) for line in open(out / "results.jsonl")]
    assert row["key"] == "small__zero3__g1__mb1__s8__ga1"
    assert row["status"] == "oom" and row["inferred"] is True and row["command"] is None
    assert row["error"].startswith("skipped: predicted OOM: host memory: needs 7.3 GiB per node")
    assert not os.path.exists(out / "cells" / row["key"] / "metrics.json")


def test_a_cell_that_fits_is_notpredicted_cell_oom(repo):
    from aidaptiv_ds.harness.grid import Cell
    from aidaptiv_ds.harness.launch import LaunchSpec
    from aidaptiv_ds.harness.sweep_skip import predicted_cell_oom

    spec = LaunchSpec(accelerator="cpu", ds_configs=os.path.join(repo, "ds_configs"))
    ctx = {
        "spec": spec,
        "cap": {"gb": 5.0},
        "machine": {},
        "gpu_mem_cap_gb": None,
        "framework": 1 << 30,
        "launcher": 0,
        "grid_obj": None,
    }
    assert predicted_cell_oom(Cell("micro", "zero3", 1, 2, 64, 1), ctx) is None
    assert "host memory" in predicted_cell_oom(Cell("small", "zero3", 1, 1, 64, 1), ctx)
