"""A grid's dtype as the sweep applies it (--dry-run: nothing trains)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def test_grid_dtype_runs_every_cell_from_configs_in_that_precision(tmp_path):
    """A grid's dtype: the sweep writes OUT/ds_configs/<backend>.json with bf16 on, and every cell (the eqmem one
    through its own copy, sized from the bf16 base) is launched from those files."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sweep.py"), "--grid", "bench/grids/gpu_probe.json",
                        "--out", str(tmp_path / "o"), "--max-cells", "5", "--accelerator", "cuda", "--dry-run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
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
