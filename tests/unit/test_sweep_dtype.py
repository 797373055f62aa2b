"""A grid's dtype as the sweep applies it (--dry-run: nothing trains)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_grid_dtype_runs_every_cell_from_configs_in_that_precision(tmp_path):
    """A grid's dtype: the sweep writes OUT/ds_configs/<backend>.json with bf16 on, and every cell (the eqmem one
    through its own copy, sized from the bf16 base) is launched from those files."""
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "sweep_grid.py"),
            "--grid",
            "bench/grids/gpu_probe.json",
            "--out",
            str(tmp_path / "o"),
            "--max-cells",
            "5",
            "--accelerator",
            "cuda",
            "--dry-run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    written = tmp_path / "o" / "ds_configs"
    names = sorted(p.name for p in written.iterdir())
    assert names == ["aidaptiv.json", "zero3.json", "zero3_cpu_offload.json", "zero_infinity.json"]
    for name in names:
        cfg = json.loads((written / name).read_text())
        assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False, name
        shipped = json.loads(open(os.path.join(ROOT, "ds_configs", name)).read())
        assert cfg["zero_optimization"] == shipped["zero_optimization"]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 5
    for ln in lines:
        config = ln.split("--config ")[1].split()[0]
        assert config.startswith(str(tmp_path / "o")), ln


def _grid(tmp_path, **extra):
    grid = {
        "notes": "test",
        "models": ["tiny"],
        "micro_batches": [1],
        "seq_lens": [4096],
        "gpus": [1],
        "steps": 2,
        "warmup": 1,
        "timeout_s": 60,
        "backends": ["zero_infinity", "aidaptiv"],
        **extra,
    }
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    return str(path)


def test_grid_aidaptiv_activations_go_into_aidaptivs_config_only(tmp_path):
    """aidaptiv_activations: OUT/ds_configs/aidaptiv.json gets the block's activations as written (unset fields
    left to the block's defaults), ZeRO-Infinity's file is the shipped one, and the aidaptiv cell runs from it."""
    grid = _grid(tmp_path, aidaptiv_activations={"policy": "nvme", "loss_chunk_tokens": 512})
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "sweep_grid.py"),
            "--grid",
            grid,
            "--out",
            str(tmp_path / "o"),
            "--accelerator",
            "cpu",
            "--dry-run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    written = tmp_path / "o" / "ds_configs"
    cfg = json.loads((written / "aidaptiv.json").read_text())
    assert cfg["aidaptiv"]["activations"] == {"policy": "nvme", "loss_chunk_tokens": 512}
    shipped = json.loads(open(os.path.join(ROOT, "ds_configs", "zero_infinity.json")).read())
    assert json.loads((written / "zero_infinity.json").read_text()) == shipped
    aidaptiv_cmd = [ln for ln in r.stdout.splitlines() if "aidaptiv.json" in ln]
    assert aidaptiv_cmd and f"--config {written / 'aidaptiv.json'}" in aidaptiv_cmd[0]


def test_grid_aidaptiv_activations_are_validated_with_the_block(tmp_path):
    """A policy the block does not know is a grid problem, found before any cell runs."""
    import pytest

    from aidaptiv_ds.harness.grid import GridError, load_grid

    with pytest.raises(GridError, match="aidaptiv_activations.policy"):
        load_grid(_grid(tmp_path, aidaptiv_activations={"policy": "ssd"}))
