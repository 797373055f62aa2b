"""Two SLURM array tasks of one grid, run at the same time without SLURM, both appending to one results
folder; then the same tasks again (a requeue), which must add nothing."""

import os
import subprocess
import sys

import pytest
from sweep_fakes import ROOT, rows_of, write_grid


@pytest.mark.long("tests/cluster/test_sbatch.py submits the array to a real SLURM controller")
def test_concurrent_array_tasks_and_requeue(fake_env, tmp_path):
    grid = write_grid(tmp_path / "g.json", micro_batches=[1, 2], backends=["zero3"])
    out = str(tmp_path / "shared-results")
    env = dict(
        os.environ,
        GRID=grid,
        OUT=out,
        REPO=ROOT,
        TMPDIR=str(tmp_path),
        SLURM_JOB_ID="9",
        SWEEP=f"{sys.executable} {os.path.join(ROOT, 'bench', 'sweep_grid.py')}",
        SWEEP_ARGS=f"--ds-configs {fake_env}",
    )

    def tasks():
        procs = [
            subprocess.Popen(
                ["bash", os.path.join(ROOT, "bench", "slurm", "sweep_array.sbatch")],
                env=dict(env, SLURM_ARRAY_TASK_ID=str(i)),
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in (0, 1)
        ]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err

    tasks()
    rows = rows_of(out)
    assert sorted(r["key"] for r in rows) == ["micro__zero3__g1__mb1__s8__ga1", "micro__zero3__g1__mb2__s8__ga1"]
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["machine"]["swap_disk"]["path"] == str(tmp_path / "aidaptiv-swap-9") for r in rows)
    assert os.listdir(tmp_path / "aidaptiv-swap-9") == []  # each cell's swap folder removed
    tasks()  # requeued: both cells already have rows
    assert len(rows_of(out)) == 2
