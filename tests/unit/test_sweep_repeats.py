"""Repeats of a sweep: runs interleaved across repeats, rows without a repeat read as repeat 0, an OOM in one
repeat skips the cell's later repeats, and the report's medians, spreads and per-repeat ratios."""

import json
import uuid

import pytest

from aidaptiv_ds.harness.grid import (
    Cell,
    Run,
    enumerate_cells,
    interleave_repeats,
    validate_grid,
)
from aidaptiv_ds.harness.report import build_report
from aidaptiv_ds.harness.report_tables import cell_summaries, ratios
from aidaptiv_ds.harness.results import Row, append_row, load_rows
from aidaptiv_ds.harness.sweep_skip import dominating_oom


def grid(**kw):
    g = {
        "notes": "n",
        "models": ["tiny"],
        "micro_batches": [1, 2],
        "seq_lens": [64],
        "gpus": [1],
        "steps": 3,
        "warmup": 1,
        "timeout_s": 60,
        "backends": ["zero_infinity", "aidaptiv"],
    }
    g.update(kw)
    return validate_grid(g)


def test_runs_are_every_cell_once_then_every_cell_again():
    g = grid(repeats=3)
    cells = enumerate_cells(g)
    runs = interleave_repeats(cells, g.repeats)
    assert len(runs) == 3 * len(cells) == 12
    assert [r.repeat for r in runs] == [0] * 4 + [1] * 4 + [2] * 4
    assert [r.cell for r in runs[4:8]] == cells and [r.cell for r in runs[8:]] == cells
    # repeat 0 keeps the cell's own id (old results folders and resume keys stay valid)
    assert runs[0].id == cells[0].id and runs[4].id == cells[0].id + "__r1"
    assert len({r.id for r in runs}) == 12


def test_repeats_default_to_one_and_must_be_positive():
    assert grid().repeats == 1
    with pytest.raises(ValueError, match="repeats"):
        grid(repeats=0)


def test_rows_without_a_repeat_load_as_repeat_0(tmp_path):
    old = row("aidaptiv", 100.0)
    del old["repeat"]
    (tmp_path / "results.jsonl").write_text(json.dumps(old) + "\n")
    (r,) = load_rows(str(tmp_path)).rows
    assert r["repeat"] == 0


def test_an_oom_in_an_earlier_repeat_skips_the_cell():
    ctx = {"gpu_mem_cap_gb": None, "cap": {"gb": 5.0}}
    cell = Cell("tiny", "zero_infinity", 1, 2, 64, 1)
    oom = row("zero_infinity", None, mb=2, status="oom", repeat=0)
    assert dominating_oom(cell, [oom], ctx) == "this cell ran out of memory in repeat 0"
    bigger = Cell("tiny", "zero_infinity", 1, 4, 64, 1)
    assert dominating_oom(bigger, [oom], ctx) == f"smaller cell {cell.id} ran out of memory"
    assert dominating_oom(Cell("tiny", "aidaptiv", 1, 2, 64, 1), [oom], ctx) is None
    assert Run(cell, 1).id == cell.id + "__r1"


def row(backend, tps, mb=1, status="ok", repeat=0, t="2026-03-01T10:01:00+00:00", **kw):
    r = {
        "row_id": uuid.uuid4().hex,
        "key": f"tiny__{backend}__g1__mb{mb}__s64__ga1",
        "repeat": repeat,
        "time_start": "2026-03-01T10:00:00+00:00",
        "time_end": t,
        "wall_s": 30.0,
        "backend": backend,
        "model": "tiny",
        "micro_batch": mb,
        "seq_len": 64,
        "gpus": 1,
        "grad_accum": 1,
        "steps": 6,
        "warmup": 2,
        "status": status,
        "host_mem_cap": {"gb": 5.0, "mechanism": "cgroup2"},
    }
    if status == "ok":
        r.update(tokens_per_s=tps, step_s=128 / tps)
    r.update(kw)
    return Row.model_validate(r).model_dump()


# aidaptiv and ZeRO-Infinity tokens/s per repeat at micro-batch 1; at micro-batch 2 ZeRO-Infinity fails once.
AID = [100.0, 120.0, 90.0]
ZI = [50.0, 40.0, 60.0]


def repeat_rows():
    rows = []
    for k in range(3):
        rows.append(row("aidaptiv", AID[k], repeat=k))
        rows.append(row("zero_infinity", ZI[k], repeat=k))
        rows.append(row("aidaptiv", 200.0 + k, mb=2, repeat=k))
        rows.append(
            row("zero_infinity", None, mb=2, status="oom", error="killed by the host memory cap", repeat=k)
            if k == 1
            else row("zero_infinity", 100.0 + k, mb=2, repeat=k)
        )
    # an older row of one run, superseded by the newer one of the same repeat
    rows.append(row("aidaptiv", 1.0, repeat=1, t="2026-02-01T00:00:00+00:00"))
    return rows


def test_summaries_give_median_spread_and_ok_count():
    s = {(r["backend"], r["micro_batch"]): r for r in cell_summaries(repeat_rows())}
    a = s[("aidaptiv", 1)]
    assert (a["n_runs"], a["n_ok"]) == (3, 3)
    assert a["tokens_per_s"] == 100.0 and (a["tps_min"], a["tps_max"]) == (90.0, 120.0)  # not the stale 1.0
    assert a["tps_by_repeat"] == {0: 100.0, 1: 120.0, 2: 90.0}
    z2 = s[("zero_infinity", 2)]
    assert z2["status"] == "ok" and (z2["n_runs"], z2["n_ok"]) == (3, 2) and z2["tokens_per_s"] == 101.0


def test_ratios_pair_repeats_and_give_their_spread():
    rt = ratios(repeat_rows())
    k1, k2 = ("tiny", 1, 64, 1, 1), ("tiny", 1, 64, 2, 1)
    assert rt["both"][k1] == pytest.approx(100.0 / 50.0)  # ratio of the medians
    paired = [AID[k] / ZI[k] for k in range(3)]  # 2.0, 3.0, 1.5
    assert rt["spread"][k1] == (pytest.approx(min(paired)), pytest.approx(max(paired)), 3)
    # micro-batch 2: only repeats 0 and 2 ran on both
    assert rt["spread"][k2] == (pytest.approx(202 / 102), pytest.approx(200 / 100), 2)
    assert rt["median"] == pytest.approx(statistics_median([2.0, 201 / 101]))


def statistics_median(v):
    v = sorted(v)
    return (v[len(v) // 2] + v[(len(v) - 1) // 2]) / 2


def test_report_shows_medians_spreads_and_failed_repeats(tmp_path):
    for r in repeat_rows():
        append_row(str(tmp_path / "results.jsonl"), r)
    md, _ = build_report(str(tmp_path), plots=False)
    assert "2 cell(s)" not in md.splitlines()[2] and "of their 12 runs" in md
    assert "1 older row(s) superseded" in md
    assert "| 64 | 1 | 60.0 (40.0–60.0)" not in md
    assert "50.0 (40.0–60.0)" in md and "100 (90.0–120)" in md
    assert "101 (100–102), 2/3 ok" in md
    assert "2.00× (1.50–3.00)" in md
    assert "over 3 pair(s)" not in md and "over 5 pair(s)" in md
    fails = md[md.index("### Failures") :]
    assert "| tiny__zero_infinity__g1__mb2__s64__ga1 | 1 | oom | killed by the host memory cap |" in fails


def test_report_shows_each_eqmem_cells_sizing_and_its_ratio(tmp_path):
    sizing = {
        "budget_bytes": 700 << 20,
        "sized_bytes": 690 << 20,
        "over_budget_bytes": 0,
        "parts": {},
        "sub_group_size": 7680000,
        "max_in_cpu": 24198144,
        "param_buffer_count": 5,
        "param_buffer_size": 7680000,
        "optimizer_buffer_count": 4,
        "cached_numel": 24198144,
        "partition_numel": 57837312,
    }
    rows = repeat_rows() + [row("zero_infinity_eqmem", 70.0 + k, repeat=k, eqmem=sizing) for k in range(3)]
    for r in rows:
        append_row(str(tmp_path / "results.jsonl"), r)
    md, _ = build_report(str(tmp_path), plots=False)
    assert "| 1 | 1 | 64 | 700 | 690 | 0 | 24,198,144 | 42% | 7,680,000 |" in md
    section = md[md.index("### aidaptiv / ZeRO-Infinity (aidaptiv's memory)") :]
    assert "| 64 | 1 | 1.41× (1.25–1.69) |" in section  # 100/71 of the medians; 100/70, 120/71, 90/72
