"""Row schema, building rows from train's metrics, durable appends and reading rows back."""

import json
import multiprocessing
import os

import pytest
from pydantic import ValidationError

from aidaptiv_ds.harness.cellrun import CellRun
from aidaptiv_ds.harness.grid import Cell
from aidaptiv_ds.harness.launch import LaunchSpec
from aidaptiv_ds.harness.outcome import Outcome
from aidaptiv_ds.harness.results import Row, append_row, load_rows, write_row_file
from aidaptiv_ds.harness.sweep_cell import build_row

# The fields the lead's brief asks every row to have.
REQUIRED = [
    "git_sha",
    "time_start",
    "machine",
    "backend",
    "model",
    "params",
    "micro_batch",
    "seq_len",
    "gpus",
    "grad_accum",
    "status",
    "error",
    "tokens_per_s",
    "step_s",
    "phases_s",
    "peak_gpu_mb",
    "peak_rss_mb",
    "peak_pinned_mb",
    "nvme_read_gbps",
    "nvme_write_gbps",
    "nvme_read_bytes",
    "nvme_write_bytes",
    "command",
    "wall_s",
    "inferred",
    "host_mem_cap",
]


def ctx(tmp_path, **kw):
    c = {
        "out": str(tmp_path),
        "grid": "g",
        "git_sha": "abc",
        "git_dirty": False,
        "steps": 5,
        "warmup": 2,
        "lr": None,
        "timeout_s": 60.0,
        "gpu_mem_cap_gb": None,
        "spec": LaunchSpec(),
        "cap": {"gb": 2.0, "mechanism": "cgroup1", "detail": "/sys/fs/cgroup/memory/x", "factory": None},
        "machine": {"host": "h", "cpu": "c"},
    }
    c.update(kw)
    return c


METRICS = {
    "status": "ok",
    "error": None,
    "tokens_per_s": None,
    "step_s_median": None,
    "step_s": [9.0, 9.0, 1.0, 2.0, 3.0],
    "losses": [1.0, 0.9, 0.8, 0.7, 0.6],
    "peak_rss_mb": 100,
    "peak_pinned_mb": 5,
    "peak_gpu_mb": None,
    "nvme_read_bytes": 12_000_000_000,
    "nvme_write_bytes": 6_000_000_000,
    "phases_s": {"forward": 1, "backward": 2, "optimizer": 3, "io_wait": 0.5},
    "params": 58_000_000,
    "world_size": 2,
}


def make_row(tmp_path, metrics=METRICS, status="ok", **kw):
    cell = Cell("tiny", "zero_infinity", 2, 4, 64, 1)
    run = CellRun(returncode=0, wall_s=12.5, tree_peak_rss_bytes=2**30, metrics=metrics)
    return build_row(
        cell,
        ctx=ctx(tmp_path, **kw),
        outcome=Outcome(status, None),
        run=run,
        command="deepspeed x",
        time_start="2026-01-01T00:00:00+00:00",
        time_end="2026-01-01T00:00:13+00:00",
        cell_dir=str(tmp_path / "cells" / cell.id),
    )


def test_row_from_metrics(tmp_path):
    row = make_row(tmp_path)
    for f in REQUIRED:
        assert f in row, f
    assert row["key"] == "tiny__zero_infinity__g2__mb4__s64__ga1"
    assert row["step_s"] == 2.0  # median of the timed steps [1, 2, 3], warm-up dropped
    assert row["tokens_per_s"] == 4 * 64 * 1 * 2 / 2.0  # computed when train gave none
    assert row["nvme_read_gbps"] == pytest.approx(12 / 6)  # bytes / total timed step time (6 s), GB/s
    assert row["nvme_write_gbps"] == pytest.approx(1.0)
    assert row["params"] == 58_000_000 and row["params_source"] == "metrics"
    assert row["tree_peak_rss_mb"] == 1024.0
    assert row["host_mem_cap"]["mechanism"] == "cgroup1"
    assert row["cell_dir"] == "cells/tiny__zero_infinity__g2__mb4__s64__ga1"


def test_train_figures_win_and_timed_only_step_lists(tmp_path):
    m = dict(METRICS, tokens_per_s=77.0, step_s_median=1.5, step_s=[1.0, 2.0, 3.0])  # only timed steps listed
    row = make_row(tmp_path, metrics=m)
    assert row["tokens_per_s"] == 77.0 and row["step_s"] == 1.5
    assert row["nvme_read_gbps"] == pytest.approx(12 / 6)


def test_row_without_metrics_uses_nominal_params(tmp_path):
    row = make_row(tmp_path, metrics=None, status="oom")
    assert row["tokens_per_s"] is None and row["nvme_read_gbps"] is None
    assert row["params"] == 58_000_000 and row["params_source"] == "nominal"


def test_a_cell_refused_by_the_launch_guard_is_an_inferred_oom(tmp_path):
    """Nothing was measured: the plan inside train said the job cannot fit, so the row is not a measured OOM
    (bench/plan_accuracy.py must not count the plan agreeing with itself)."""
    from aidaptiv_ds.harness.outcome import classify

    metrics = {"status": "refused", "error": "host memory: zero3 needs at least 7.3 GiB on this node"}
    outcome = classify(returncode=3, timed_out=False, metrics=metrics)
    cell = Cell("small", "zero3", 1, 1, 64, 1)
    row = build_row(
        cell,
        ctx=ctx(tmp_path),
        outcome=outcome,
        run=CellRun(returncode=3, wall_s=9.0, metrics=metrics),
        command="deepspeed x",
        time_start="2026-01-01T00:00:00+00:00",
        time_end="2026-01-01T00:00:09+00:00",
        cell_dir=str(tmp_path / "cells" / cell.id),
    )
    assert row["status"] == "oom" and row["inferred"] is True
    assert row["error"].startswith("refused before training by the plan: host memory")
    assert make_row(tmp_path, metrics=None, status="oom")["inferred"] is False  # a measured OOM stays measured


def test_schema_rejects_unknown_fields_and_statuses(tmp_path):
    row = make_row(tmp_path)
    with pytest.raises(ValidationError):
        Row.model_validate(dict(row, colour="blue"))
    with pytest.raises(ValidationError):
        Row.model_validate(dict(row, status="crashed"))
    bad = dict(row)
    del bad["key"]
    with pytest.raises(ValidationError):
        Row.model_validate(bad)


def test_append_and_load(tmp_path):
    rows = [make_row(tmp_path) for _ in range(3)]
    for r in rows:
        append_row(str(tmp_path / "results.jsonl"), r)
    loaded = load_rows(str(tmp_path))
    assert [r["row_id"] for r in loaded.rows] == [r["row_id"] for r in rows]
    assert loaded.problems == [] and loaded.recovered == 0
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_cut_off_last_line_is_skipped_and_reported(tmp_path):
    r = make_row(tmp_path)
    append_row(str(tmp_path / "results.jsonl"), r)
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write(json.dumps(make_row(tmp_path))[:100])  # a crash in the middle of a write
    loaded = load_rows(str(tmp_path))
    assert len(loaded.rows) == 1
    assert len(loaded.problems) == 1 and "line 2" in loaded.problems[0]


def test_row_files_recover_rows_missing_from_results(tmp_path):
    a, b = make_row(tmp_path), make_row(tmp_path)
    append_row(str(tmp_path / "results.jsonl"), a)
    for r in (a, b):
        d = tmp_path / "cells" / r["row_id"]
        d.mkdir(parents=True)
        write_row_file(str(d / "row.json"), r)
    loaded = load_rows(str(tmp_path))
    assert sorted(r["row_id"] for r in loaded.rows) == sorted([a["row_id"], b["row_id"]])  # no duplicate of a
    assert loaded.recovered == 1


def test_latest_by_key(tmp_path):
    old = dict(make_row(tmp_path), time_end="2026-01-01T00:00:00+00:00", status="error")
    new = dict(make_row(tmp_path), time_end="2026-01-02T00:00:00+00:00")
    for r in (new, old):
        append_row(str(tmp_path / "results.jsonl"), r)
    latest = load_rows(str(tmp_path)).latest_by_key()
    assert latest[new["key"]]["row_id"] == new["row_id"]


def _writer(path, row, n):
    for i in range(n):
        append_row(path, dict(row, row_id=f"{os.getpid()}-{i}", error="x" * 5000))


def test_concurrent_appends_never_interleave(tmp_path):
    path = str(tmp_path / "results.jsonl")
    row = make_row(tmp_path)
    ctx_ = multiprocessing.get_context("fork")
    procs = [ctx_.Process(target=_writer, args=(path, row, 40)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    loaded = load_rows(str(tmp_path))
    assert loaded.problems == []
    assert len(loaded.rows) == 160
