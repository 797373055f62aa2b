"""The SLURM scripts, run without SLURM: fake sbatch / scontrol on PATH and a SWEEP that records its
arguments, so the commands the scripts generate can be checked exactly."""

import os
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM = os.path.join(ROOT, "bench", "slurm")


def _exe(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def fakes(tmp_path):
    """A bin/ with recording sbatch and scontrol, and a recording SWEEP; returns (env, log file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    _exe(
        bin_dir / "sbatch",
        f'#!/bin/bash\necho "sbatch $* GRID=$GRID OUT=$OUT SWEEP_ARGS=$SWEEP_ARGS" >> {log}\n'
        'echo "Submitted batch job 4242"\n',
    )
    _exe(bin_dir / "scontrol", '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a01\\ngpu-a02\\n"\n')
    record = _exe(tmp_path / "record_sweep", f'#!/bin/bash\necho "sweep $*" >> {log}\n')
    env = dict(
        os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(tmp_path / "tmp"), SLURM_JOB_ID="77"
    )
    for k in (
        "GRID",
        "OUT",
        "SWEEP_ARGS",
        "SLURM_ARRAY_TASK_ID",
        "SWAP_ROOT",
        "CELL_INDEX",
        "REPO",
        "GPUS",
        "PARALLEL",
    ):
        env.pop(k, None)
    return env, log, record


def test_submit_sizes_the_array_from_the_grid(fakes, tmp_path):
    env, log, _ = fakes
    env["SWEEP"] = f"{sys.executable} {os.path.join(ROOT, 'bench', 'sweep_grid.py')}"
    out = str(tmp_path / "results")
    r = subprocess.run(
        ["bash", os.path.join(SLURM, "submit_array.sh"), "bench/grids/cpu_ci.json", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "Submitted batch job 4242" in r.stdout
    call = log.read_text().strip()
    assert call.startswith("sbatch --export=ALL --array=0-7%4 --gpus=2 ")  # cpu_ci: 8 cells, up to 2 GPUs
    assert call.endswith(f"sweep_array.sbatch GRID=bench/grids/cpu_ci.json OUT={out} SWEEP_ARGS=")
    log.unlink()
    env["PARALLEL"] = "2"
    r = subprocess.run(
        [
            "bash",
            os.path.join(SLURM, "submit_array.sh"),
            "bench/grids/cpu_ci.json",
            out,
            "--gpus",
            "1",
            "--backends",
            "aidaptiv,zero_infinity",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    call = log.read_text().strip()
    assert "--array=0-1%2 --gpus=1 " in call and call.endswith("SWEEP_ARGS=--gpus 1 --backends aidaptiv,zero_infinity")
    # CPU nodes: no GPU request (GPUS=0 overrides the script's own --gpus=2, which such a cluster refuses)
    log.unlink()
    r = subprocess.run(
        ["bash", os.path.join(SLURM, "submit_array.sh"), "bench/grids/cpu_ci.json", out],
        cwd=ROOT,
        env=dict(env, GPUS="0", SBATCH_ARGS="--cpus-per-task=1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "--array=0-7%2 --gpus=0 --cpus-per-task=1 " in log.read_text()


def test_array_task_runs_its_cell_with_resume(fakes, tmp_path):
    env, log, record = fakes
    env.update(
        GRID="bench/grids/cpu_ci.json",
        OUT="/shared/res",
        SLURM_ARRAY_TASK_ID="5",
        SWEEP=record,
        SWEEP_ARGS="--host-mem-cap-gb 8",
        REPO=ROOT,
    )
    r = subprocess.run(["bash", os.path.join(SLURM, "sweep_array.sbatch")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert log.read_text().strip() == (
        f"sweep --grid bench/grids/cpu_ci.json --out /shared/res --cell-index 5 --resume "
        f"--swap-root {tmp_path}/tmp/aidaptiv-swap-77 --no-progress --host-mem-cap-gb 8"
    )


def test_array_task_refuses_to_run_outside_an_array(fakes):
    env, log, record = fakes
    env.update(GRID="g.json", OUT="/o", SWEEP=record, REPO=ROOT)
    r = subprocess.run(["bash", os.path.join(SLURM, "sweep_array.sbatch")], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "array" in r.stderr
    assert not log.exists()


def test_multinode_builds_the_hostfile_and_the_command(fakes, tmp_path):
    env, log, record = fakes
    out = tmp_path / "res"
    env.update(
        GRID="bench/grids/cdac_siddhi.json",
        OUT=str(out),
        SWEEP=record,
        REPO=ROOT,
        SLURM_JOB_NODELIST="gpu-a[01-02]",
        SLURM_GPUS_PER_NODE="a100:4",
        SWAP_ROOT="/local/nvme/swap",
    )
    r = subprocess.run(["bash", os.path.join(SLURM, "sweep_multinode.sbatch")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    hostfile = out / "hostfile.77"
    assert hostfile.read_text() == "gpu-a01 slots=4\ngpu-a02 slots=4\n"
    assert log.read_text().strip() == (
        f"sweep --grid bench/grids/cdac_siddhi.json --out {out} --resume --hostfile {hostfile} --gpus-per-node 4 "
        f"--master-addr gpu-a01 --ds-launcher pdsh --swap-root /local/nvme/swap --no-progress"
    )
    log.unlink()
    env.update(CELL_INDEX="3", DS_LAUNCHER="slurm")
    subprocess.run(["bash", os.path.join(SLURM, "sweep_multinode.sbatch")], env=env, check=True, capture_output=True)
    assert "--ds-launcher slurm" in log.read_text() and "--cell-index 3" in log.read_text()


def test_multinode_cell_command_spans_nodes(tmp_path):
    """What the sweep then runs for an 8-GPU cell on 4-GPU nodes (the generated deepspeed command)."""
    ds = tmp_path / "ds"
    ds.mkdir()
    for b in ("zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv"):
        (ds / f"{b}.json").write_text("{}")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu-a01 slots=4\ngpu-a02 slots=4\n")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "sweep_grid.py"),
            "--grid",
            "bench/grids/cdac_siddhi.json",
            "--out",
            str(tmp_path / "o"),
            "--ds-configs",
            str(ds),
            "--hostfile",
            str(hostfile),
            "--gpus-per-node",
            "4",
            "--master-addr",
            "gpu-a01",
            "--gpus",
            "4,8",
            "--backends",
            "aidaptiv",
            "--dry-run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    eight = [ln for ln in lines if "__g8__" in ln]
    four = [ln for ln in lines if "__g4__" in ln]
    assert eight and four
    assert f"--hostfile {hostfile} --num_nodes 2 --num_gpus 4 --master_addr gpu-a01 " in eight[0]
    assert f"--hostfile {hostfile} --num_nodes 1 --num_gpus 4 --master_addr gpu-a01 " in four[0]
    assert "--gpu-mem-cap-gb 40" in eight[0]  # from the grid
    assert all(" --create-nvme-path" in ln for ln in eight + four)  # each node's rank makes its swap folder
