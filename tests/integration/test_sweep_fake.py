"""Sweeps through the real deepspeed launcher with a fake trainer that succeeds, hangs, crashes, runs out of
memory or goes over the host memory cap. Each cell costs ~5 s of launcher start-up on a small machine."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from sweep_fakes import ROOT, leftovers, rows_of, write_grid

from aidaptiv_ds.cli import main as aidaptiv_ds_main
from aidaptiv_ds.harness.hostcap import probe_cgroup


def sweep(argv):
    """`aidaptiv-ds sweep ARGV`, in this process."""
    return aidaptiv_ds_main(["sweep", *argv])


PLAN = {"1": "ok", "2": "alloc:1500", "3": "hang", "4": "crash", "5": "oom"}


@pytest.fixture
def mixed_sweep(fake_env, tmp_path, monkeypatch):
    """One sweep with an ok cell, one over a 1 GiB host cap, a hang, a crash, an OOM and a 2-process cell."""
    monkeypatch.setenv("FAKE_TRAIN_PLAN", json.dumps(PLAN))
    grid = write_grid(
        tmp_path / "g.json",
        models=["micro", "tiny"],
        micro_batches=[1, 2, 3, 4, 5],
        timeout_s=20,
        per_model={"tiny": {"micro_batches": [1], "gpus": [2]}},
    )
    out = str(tmp_path / "out")
    rc = sweep(
        [
            "--grid",
            grid,
            "--out",
            out,
            "--ds-configs",
            fake_env,
            "--host-mem-cap-gb",
            "1",
            "--no-skip-dominated",
            "--no-progress",
            "--no-prebuild",
        ]
    )
    return rc, grid, out


def test_mixed_sweep_records_every_outcome_and_finishes(mixed_sweep, fake_env, tmp_path, monkeypatch):
    rc, grid, out = mixed_sweep
    assert rc == 0
    rows = {r["key"]: r for r in rows_of(out)}
    status = {k: (r["status"], r["error"]) for k, r in rows.items()}
    assert len(rows) == 6, status

    ok = rows["micro__zero3__g1__mb1__s8__ga1"]
    assert ok["status"] == "ok" and ok["error"] is None and ok["exit_code"] == 0
    assert ok["tokens_per_s"] > 0 and ok["step_s"] > 0 and ok["nvme_read_gbps"] > 0
    assert "--module fake_train" in ok["command"] and "--no_local_rank" in ok["command"]
    assert ok["host_mem_cap"]["gb"] == 1.0

    capped = rows["micro__zero3__g1__mb2__s8__ga1"]
    assert capped["status"] == "oom", capped
    assert "host memory cap" in capped["error"]
    factory, _ = probe_cgroup()
    expected = factory.kind if factory else "rss-watchdog"
    assert capped["host_mem_cap"]["mechanism"] == expected
    assert capped["host_mem_cap"]["oom_kills"] >= 1
    assert capped["wall_s"] < 20  # killed by the cap, not by the timeout

    hang = rows["micro__zero3__g1__mb3__s8__ga1"]
    assert hang["status"] == "timeout" and "20 s" in hang["error"]
    assert 20 <= hang["wall_s"] < 30

    crash = rows["micro__zero3__g1__mb4__s8__ga1"]
    assert crash["status"] == "error"
    assert crash["error"] == "RuntimeError: fake crash in layer 3: tensor shape mismatch"

    oom = rows["micro__zero3__g1__mb5__s8__ga1"]
    assert oom["status"] == "oom" and "CUDA out of memory" in oom["error"] and oom["exit_code"] == 3

    two = rows["tiny__zero3__g2__mb1__s8__ga1"]
    assert two["status"] == "ok" and two["world_size"] == 2
    assert two["tokens_per_s"] == pytest.approx(1 * 8 * 2 / two["step_s"], rel=1e-6)

    for r in rows.values():  # logs kept, swap folders gone, nothing left running
        d = os.path.join(out, r["cell_dir"])
        assert os.path.exists(os.path.join(d, "stderr.log")) and os.path.exists(os.path.join(d, "row.json"))
        assert not os.path.exists(os.path.join(d, "swap"))
    assert leftovers(str(tmp_path)) == []

    # --resume: only the cell whose row is missing runs again
    with open(os.path.join(out, "results.jsonl")) as f:
        kept = [ln for ln in f if '"micro__zero3__g1__mb4__s8__ga1"' not in ln]
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        f.writelines(kept)
    os.remove(os.path.join(out, "cells", "micro__zero3__g1__mb4__s8__ga1", "row.json"))
    t = time.monotonic()
    rc = sweep(
        [
            "--grid",
            grid,
            "--out",
            out,
            "--ds-configs",
            fake_env,
            "--host-mem-cap-gb",
            "1",
            "--no-skip-dominated",
            "--no-progress",
            "--resume",
            "--no-prebuild",
        ]
    )
    assert rc == 0
    after = rows_of(out)
    assert len(after) == 6
    assert after[-1]["key"] == "micro__zero3__g1__mb4__s8__ga1" and after[-1]["status"] == "error"
    assert time.monotonic() - t < 20  # the hang (20 s) was not rerun


def test_watchdog_mechanism_kills_over_the_cap(fake_env, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN_PLAN", json.dumps({"1": "alloc:1500"}))
    grid = write_grid(tmp_path / "g.json", timeout_s=40)
    out = str(tmp_path / "out")
    assert (
        sweep(
            [
                "--grid",
                grid,
                "--out",
                out,
                "--ds-configs",
                fake_env,
                "--host-mem-cap-gb",
                "1",
                "--host-mem-cap-mechanism",
                "rss-watchdog",
                "--no-progress",
                "--no-prebuild",
            ]
        )
        == 0
    )
    (row,) = rows_of(out)
    assert row["status"] == "oom" and "rss-watchdog" in row["error"]
    assert row["host_mem_cap"]["mechanism"] == "rss-watchdog"
    assert row["tree_peak_rss_mb"] > 1024
    assert row["wall_s"] < 35


def test_skip_dominated_infers_oom(fake_env, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN_PLAN", json.dumps({"1": "ok", "2": "oom", "4": "ok"}))
    grid = write_grid(tmp_path / "g.json", micro_batches=[1, 2, 4], seq_lens=[8, 16])
    out = str(tmp_path / "out")
    assert sweep(["--grid", grid, "--out", out, "--ds-configs", fake_env, "--no-progress", "--no-prebuild"]) == 0
    rows = {r["key"]: r for r in rows_of(out)}
    assert len(rows) == 6
    measured = "micro__zero3__g1__mb2__s8__ga1"
    assert rows[measured]["status"] == "oom" and not rows[measured]["inferred"]
    for k in ("micro__zero3__g1__mb2__s16__ga1", "micro__zero3__g1__mb4__s8__ga1", "micro__zero3__g1__mb4__s16__ga1"):
        assert rows[k]["status"] == "oom" and rows[k]["inferred"] is True, rows[k]
        assert rows[k]["error"] == f"skipped: smaller cell {measured} ran out of memory"
        assert rows[k]["command"] is None
    assert rows["micro__zero3__g1__mb1__s16__ga1"]["status"] == "ok"  # smaller batch: not dominated

    # A new run (no --resume) of a build that fixed the OOM: the old OOM row must not stop the bigger cell.
    monkeypatch.setenv("FAKE_TRAIN_PLAN", json.dumps({}))
    assert (
        sweep(
            [
                "--grid",
                grid,
                "--out",
                out,
                "--ds-configs",
                fake_env,
                "--no-progress",
                "--no-prebuild",
                "--cell-index",
                "3",
            ]
        )
        == 0
    )
    (new,) = rows_of(out)[6:]
    assert (new["key"], new["status"], new["inferred"]) == ("micro__zero3__g1__mb4__s8__ga1", "ok", False)


def test_cell_index_and_listing(fake_env, tmp_path, capsys):
    grid = write_grid(tmp_path / "g.json", micro_batches=[1, 2], backends=["zero3", "aidaptiv"])
    assert sweep(["--grid", grid, "--count-cells"]) == 0
    assert capsys.readouterr().out.strip() == "4"
    assert sweep(["--grid", grid, "--list-cells"]) == 0
    listed = capsys.readouterr().out.split("\n")
    assert listed[0] == "0 micro__zero3__g1__mb1__s8__ga1"
    out = str(tmp_path / "out")
    assert (
        sweep(
            [
                "--grid",
                grid,
                "--out",
                out,
                "--ds-configs",
                fake_env,
                "--cell-index",
                "3",
                "--resume",
                "--no-progress",
                "--no-prebuild",
            ]
        )
        == 0
    )
    assert [r["key"] for r in rows_of(out)] == [listed[3].split()[1]]
    # the same array task again (a requeued job): --resume makes it a no-op
    assert (
        sweep(
            [
                "--grid",
                grid,
                "--out",
                out,
                "--ds-configs",
                fake_env,
                "--cell-index",
                "3",
                "--resume",
                "--no-progress",
                "--no-prebuild",
            ]
        )
        == 0
    )
    assert len(rows_of(out)) == 1
    assert sweep(["--grid", grid, "--out", out, "--ds-configs", fake_env, "--cell-index", "4"]) == 2


def test_missing_configs_are_all_reported(fake_env, tmp_path, capsys):
    grid = write_grid(tmp_path / "g.json", backends=["zero3", "aidaptiv", "zero_infinity"])
    rc = sweep(["--grid", grid, "--out", str(tmp_path / "out"), "--ds-configs", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2
    assert all(f"backend {b}:" in err for b in ("zero3", "aidaptiv", "zero_infinity"))


def test_sigterm_kills_the_running_cell(fake_env, tmp_path):
    env = dict(os.environ, FAKE_TRAIN_PLAN=json.dumps({"1": "hang"}))
    grid = write_grid(tmp_path / "g.json", timeout_s=300)
    out = str(tmp_path / "out")
    p = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "sweep_grid.py"),
            "--grid",
            grid,
            "--out",
            out,
            "--ds-configs",
            fake_env,
            "--host-mem-cap-gb",
            "2",
            "--no-progress",
            "--no-prebuild",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not leftovers(str(tmp_path), ranks_only=True):
        time.sleep(0.2)
    assert leftovers(str(tmp_path), ranks_only=True), "the fake rank never started"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "--resume" in err
    assert not os.path.exists(os.path.join(out, "results.jsonl"))
    time.sleep(0.5)
    assert leftovers(str(tmp_path)) == []
    assert not os.path.exists(os.path.join(out, "cells", "micro__zero3__g1__mb1__s8__ga1", "swap"))


def test_repeats_interleave_resume_and_size_eqmem_configs(fake_env, tmp_path, monkeypatch, capsys):
    """Two cells x 2 repeats: the runs go cell by cell, then again; an interrupted sweep (here: one array task
    done) resumes with the runs it lacks; a zero_infinity_eqmem cell gets its sized config in its folder."""
    monkeypatch.setenv("FAKE_TRAIN_PLAN", json.dumps({}))
    grid = write_grid(
        tmp_path / "g.json",
        models=["tiny"],
        repeats=2,
        aidaptiv_state_fraction=0.6,
        backends=["zero_infinity_eqmem", "aidaptiv"],
    )
    (tmp_path / "ds_configs" / "zero_infinity.json").write_text(
        open(os.path.join(ROOT, "ds_configs", "zero_infinity.json")).read()
    )
    assert sweep(["--grid", grid, "--list-cells"]) == 0
    listed = [ln.split()[1] for ln in capsys.readouterr().out.splitlines()]
    assert listed == [
        "tiny__zero_infinity_eqmem__g1__mb1__s8__ga1",
        "tiny__aidaptiv__g1__mb1__s8__ga1",
        "tiny__zero_infinity_eqmem__g1__mb1__s8__ga1__r1",
        "tiny__aidaptiv__g1__mb1__s8__ga1__r1",
    ]
    out = str(tmp_path / "out")
    common = ["--grid", grid, "--out", out, "--ds-configs", fake_env, "--no-progress", "--no-prebuild"]
    assert sweep(common + ["--cell-index", "1"]) == 0
    assert sweep(common + ["--resume"]) == 0
    rows = rows_of(out)
    assert [(r["key"].split("__")[1], r["repeat"]) for r in rows] == [
        ("aidaptiv", 0),
        ("zero_infinity_eqmem", 0),
        ("zero_infinity_eqmem", 1),
        ("aidaptiv", 1),
    ]
    assert all(r["status"] == "ok" for r in rows)
    eq = rows[2]
    assert eq["cell_dir"] == "cells/tiny__zero_infinity_eqmem__g1__mb1__s8__ga1__r1"
    cfg = json.load(open(os.path.join(out, eq["cell_dir"], "ds_config.json")))
    assert f"--config {os.path.join(out, eq['cell_dir'], 'ds_config.json')}" in eq["command"]
    assert cfg["zero_optimization"]["offload_param"]["max_in_cpu"] == eq["eqmem"]["max_in_cpu"] > 0
    assert eq["eqmem"]["sized_bytes"] <= eq["eqmem"]["budget_bytes"] == rows[0]["aidaptiv_host_budget_bytes"]
    assert sweep(common + ["--resume"]) == 0  # nothing left: no new rows
    assert len(rows_of(out)) == 4
