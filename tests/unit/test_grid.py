"""Grid files: every shipped grid validates, the paper grids have the published values, and a bad grid
reports all of its problems at once."""

import glob
import os
import subprocess
import sys

import pytest

from aidaptiv_ds.harness.grid import (
    BACKENDS,
    PRESETS,
    GridError,
    enumerate_cells,
    load_grid,
    validate_grid,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRIDS = sorted(glob.glob(os.path.join(ROOT, "bench", "grids", "*.json")))


def test_the_expected_grids_ship():
    names = {os.path.basename(p) for p in GRIDS}
    assert {
        "cdac_rudra.json",
        "cdac_siddhi.json",
        "cdac_70b_batch.json",
        "signal65.json",
        "cpu_small.json",
        "cpu_ci.json",
    } <= names


@pytest.mark.parametrize("path", GRIDS, ids=os.path.basename)
def test_shipped_grid_loads_and_expands(path):
    grid = load_grid(path)
    cells = enumerate_cells(grid)
    assert cells, "a grid with no cells"
    assert len({c.id for c in cells}) == len(cells), "cell ids must be unique"
    assert grid.name == os.path.basename(path)[:-5]
    assert len(grid.notes) > 40, "say where the grid comes from"


def _cells(name):
    return enumerate_cells(load_grid(os.path.join(ROOT, "bench", "grids", name)))


def test_rudra_is_table_vi():
    cells = _cells("cdac_rudra.json")
    assert {c.model for c in cells} == {"llama2-7b", "llama3.1-8b"}
    assert {c.seq_len for c in cells} == {128, 256, 512, 1024, 2048}
    assert {c.micro_batch for c in cells} == {8, 16, 24, 32}
    assert {c.gpus for c in cells} == {1, 2}
    assert {c.backend for c in cells} == set(BACKENDS)
    assert len(cells) == 2 * 5 * 4 * 2 * 4


def test_signal65_has_per_model_batches():
    grid = load_grid(os.path.join(ROOT, "bench", "grids", "signal65.json"))
    cells = enumerate_cells(grid)
    batches = {}
    for c in cells:
        batches.setdefault(c.model, set()).add(c.micro_batch)
        assert c.seq_len == 12000 and c.grad_accum == 10
    assert batches == {"llama3.1-8b": {18}, "llama3.1-70b": {9}, "qwen2.5-7b": {14}, "qwen2.5-72b": {8}}
    assert {c.gpus for c in cells} == {1, 2, 4}
    assert grid.lr == 7e-6 and grid.gpu_mem_cap_gb == 48


def test_70b_batch_grid_is_figure_8():
    cells = _cells("cdac_70b_batch.json")
    assert {c.model for c in cells} == {"llama3.1-70b"}
    assert {c.seq_len for c in cells} == {256}
    assert min(c.micro_batch for c in cells) == 1 and max(c.micro_batch for c in cells) == 80
    assert {c.gpus for c in cells} == {1, 2}


def test_siddhi_has_table_iii_and_figure_2_batches():
    cells = _cells("cdac_siddhi.json")
    assert {c.gpus for c in cells} == set(range(1, 9))
    by_model = {}
    for c in cells:
        by_model.setdefault(c.model, set()).add((c.micro_batch, c.seq_len))
    assert (4, 2048) in by_model["llama2-7b"] and (33, 2048) in by_model["llama2-7b"]
    assert (4, 512) in by_model["llama2-13b"]
    assert (1, 2048) in by_model["llama2-70b"]


def test_ci_grid_is_cheap():
    cells = _cells("cpu_ci.json")
    assert len(cells) <= 8  # CI runs the 1-process half: 4 cells of 10-30 s of mostly DeepSpeed start-up
    assert {c.model for c in cells} <= {"micro", "tiny"}
    assert {c.backend for c in cells} == set(BACKENDS)


def test_cpu_small_runs_all_backends_on_small_presets():
    cells = _cells("cpu_small.json")
    assert {c.model for c in cells} == {"tiny", "small"}
    assert len(cells) == 20
    assert {c.backend for c in cells} == set(BACKENDS)
    assert {(c.micro_batch, c.seq_len, c.gpus) for c in cells if c.model == "tiny"} == {
        (2, 64, 1),
        (4, 64, 1),
        (2, 64, 2),
        (4, 64, 2),
    }


def test_bad_grid_lists_every_problem():
    bad = {
        "models": ["gpt9", "micro"],  # 1 unknown preset
        "micro_batches": [0, 2],  # 2 not positive
        "seq_lens": [64],
        "gpus": [1],
        "steps": 2,
        "warmup": 2,  # 3 no timed step
        "timeout_s": -1,  # 4 not > 0
        "backends": ["zero4"],  # 5 unknown backend
        "colour": "blue",  # 6 unknown key
        "per_model": {
            "tiny": {"seq_lens": [64]},  # 7 not in models
            "micro": {"micro_batch": [1]},
        },  # 8 unknown key in an override
    }
    with pytest.raises(GridError) as e:
        validate_grid(bad, "bad.json")
    text = "\n".join(e.value.problems)
    for needle in (
        "gpt9",
        "micro_batches",
        "warmup (2) must be smaller",
        "timeout_s",
        "zero4",
        "colour",
        "['tiny']",
        "per_model.micro.micro_batch: Extra",
    ):
        assert needle in text, f"{needle!r} not reported in:\n{text}"
    assert len(e.value.problems) == 8
    assert "bad.json" in str(e.value)


def test_missing_lists_must_come_from_per_model():
    data = {
        "notes": "n",
        "models": ["micro", "tiny"],
        "seq_lens": [8],
        "gpus": [1],
        "steps": 3,
        "warmup": 1,
        "timeout_s": 10,
        "per_model": {"micro": {"micro_batches": [1]}},
    }
    with pytest.raises(GridError) as e:
        validate_grid(data)
    assert e.value.problems == ["micro_batches is missing: give it at the top level or in per_model for ['tiny']"]
    data["per_model"]["tiny"] = {"micro_batches": [2]}
    assert validate_grid(data).values_for("tiny")[0] == [2]


def test_unreadable_and_invalid_json(tmp_path):
    p = tmp_path / "g.json"
    p.write_text("{not json")
    with pytest.raises(GridError, match="not valid JSON"):
        load_grid(str(p))
    with pytest.raises(GridError, match="cannot be read"):
        load_grid(str(tmp_path / "missing.json"))


def test_presets_cover_the_contract():
    assert set(PRESETS) == {
        "micro",
        "micro-tied",
        "tiny",
        "small",
        "tinyllama-1.1b",
        "llama2-7b",
        "llama2-13b",
        "llama2-70b",
        "llama3.1-8b",
        "llama3.1-70b",
        "qwen2.5-3b",
        "qwen2.5-7b",
        "qwen2.5-72b",
        "micro-moe",
        "tiny-moe",
        "small-moe",
        "medium-moe",
        "olmoe-1b-7b",
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "mixtral-8x7b",
        "gpt-oss-20b",
        "gpt-oss-120b",
    }


def test_the_harness_reads_presets_and_backends_without_torch():
    """grid takes the presets and backend names from the product's one table and tuple, as plain data."""
    code = (
        "import sys; import aidaptiv_ds.harness.grid, aidaptiv_ds.harness.report, aidaptiv_ds.harness.sweep; "
        "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_grid_without_notes_loads():
    """The free-text notes are for the shipped grids' readers (checked above); a user's own grid may leave them out."""
    data = {"models": ["micro"], "micro_batches": [1], "seq_lens": [64], "gpus": [1], "steps": 3, "warmup": 1}
    grid = validate_grid({**data, "timeout_s": 600}, "mine.json")
    assert grid.notes is None and enumerate_cells(grid)


def test_a_sweep_started_outside_the_checkout_finds_the_shipped_configs(tmp_path, monkeypatch):
    from aidaptiv_ds.harness.sweep import default_ds_configs

    monkeypatch.chdir(tmp_path)
    found = default_ds_configs()
    assert os.path.isfile(os.path.join(found, "aidaptiv.json")) and not found.startswith(str(tmp_path))
    (tmp_path / "ds_configs").mkdir()
    assert default_ds_configs() == str(tmp_path / "ds_configs")
