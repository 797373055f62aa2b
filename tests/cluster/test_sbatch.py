"""The sbatch scripts of bench/slurm/ submitted to a real SLURM controller (tests/cluster/conftest.py): real
array tasks of a tiny CPU grid on the cluster's nodes, and the multi-node sweep with DeepSpeed's pdsh launcher
(ssh between the nodes' namespaces) and its slurm launcher (srun)."""

import json
import os

import pytest
from conftest import PYTHON
from helpers import REPO

SLURM = os.path.join(REPO, "bench", "slurm")
SWEEP = f"{PYTHON} {os.path.join(REPO, 'bench', 'sweep_grid.py')}"


def _grid(folder, **kw):
    grid = {
        "notes": "tests/cluster: a tiny CPU grid",
        "models": ["micro"],
        "micro_batches": [1],
        "seq_lens": [32],
        "gpus": [1],
        "steps": 2,
        "warmup": 1,
        "timeout_s": 300,
        "backends": ["aidaptiv"],
    }
    grid.update(kw)
    path = os.path.join(folder, "grid.json")
    with open(path, "w") as f:
        json.dump(grid, f)
    return path


def _rows(out):
    with open(os.path.join(out, "results.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _folder(cluster, name):
    path = os.path.join(cluster.shared, name)
    os.makedirs(path)
    return path


def _outputs(folder):
    return {f: open(os.path.join(folder, f)).read() for f in sorted(os.listdir(folder)) if f.startswith("slurm-")}


def test_array_tasks_rows_land_once_and_a_resubmission_runs_only_what_is_missing(cluster):
    folder = _folder(cluster, "array")
    grid = _grid(folder, micro_batches=[1, 2])
    out = os.path.join(folder, "out")
    env = cluster.job_env(
        REPO=REPO, SWEEP=SWEEP, SWAP_ROOT=os.path.join(cluster.local, "swap-array"), GRID=grid, OUT=out
    )
    # Task 0 alone (as after a partial array): one whole node (2 CPUs), no GPU request.
    first = cluster.sbatch(
        "--export=ALL", "--array=0", "--gpus=0", "--cpus-per-task=2", f"--chdir={folder}",
        os.path.join(SLURM, "sweep_array.sbatch"), env=env,
    )  # fmt: skip
    assert cluster.wait(first, 600) == {f"{first}_0": "COMPLETED"}, _outputs(folder)
    rows = _rows(out)
    assert [r["key"] for r in rows] == ["micro__aidaptiv__g1__mb1__s32__ga1"] and rows[0]["status"] == "ok"
    # The whole array through submit_array.sh: task 0's cell has its row (nothing run), task 1 runs its own.
    r = cluster.run(
        "bash", os.path.join(SLURM, "submit_array.sh"), grid, out,
        env=dict(env, GPUS="0", SBATCH_ARGS=f"--cpus-per-task=2 --chdir={folder}"), cwd=folder,
    )  # fmt: skip
    job = r.stdout.split()[-1]
    assert cluster.wait(job, 600) == {f"{job}_0": "COMPLETED", f"{job}_1": "COMPLETED"}, _outputs(folder)
    rows = _rows(out)
    assert sorted(r["key"] for r in rows) == [
        "micro__aidaptiv__g1__mb1__s32__ga1",
        "micro__aidaptiv__g1__mb2__s32__ga1",
    ]
    assert all(r["status"] == "ok" for r in rows)
    logs = _outputs(folder)
    assert "1 skipped (resume)" in logs[f"slurm-aidaptiv-sweep-{job}_0.out"]
    assert "skipped" not in logs[f"slurm-aidaptiv-sweep-{job}_1.out"]
    # Each cell swapped on its node's own folder (the same path on every node, each node's disk behind it).
    assert all(r["machine"]["swap_disk"]["path"] == env["SWAP_ROOT"] for r in rows)
    # A real requeue of the finished array: both tasks run again and add nothing.
    cluster.requeue(job)
    states = cluster.wait(job, 300)
    assert set(states.values()) == {"COMPLETED"}, (states, _outputs(folder))
    assert len(_rows(out)) == 2
    assert "1 skipped (resume)" in _outputs(folder)[f"slurm-aidaptiv-sweep-{job}_1.out"]  # the requeued task 1
    assert "Restarts=1" in cluster.run("scontrol", "-o", "show", "job", f"{job}_1").stdout


def _hosts(hostfile):
    with open(hostfile) as f:
        return [line.split()[0] for line in f if line.strip()]


@pytest.mark.parametrize("launcher", ["pdsh", "slurm"])
def test_multinode_sweep_cell_spans_two_nodes(cluster, launcher, tmp_path):
    """A 2-process cell on two nodes of one process each: DS_LAUNCHER=pdsh starts the ranks over ssh between
    the nodes' namespaces, DS_LAUNCHER=slurm with srun; both give the same losses."""
    folder = _folder(cluster, f"multinode-{launcher}")
    grid = _grid(folder, gpus=[2])
    out = os.path.join(folder, "out")
    ds_env = os.path.join(folder, "ds_env")  # what the ranks on the other node need beyond PYTHON* (DeepSpeed reads it)
    with open(ds_env, "w") as f:
        f.write(f"TORCH_EXTENSIONS_DIR={cluster.env['TORCH_EXTENSIONS_DIR']}\nOMP_NUM_THREADS=1\n")
    swap = f"swap-mn-{launcher}"
    env = cluster.job_env(
        REPO=REPO, SWEEP=SWEEP, SWAP_ROOT=os.path.join(cluster.local, swap), GRID=grid, OUT=out,
        GPUS_PER_NODE="1", DS_LAUNCHER=launcher, DS_ENV_FILE=ds_env,
    )  # fmt: skip
    job = cluster.sbatch(
        "--export=ALL", "--gpus-per-node=0", "--cpus-per-task=2", f"--chdir={folder}",
        os.path.join(SLURM, "sweep_multinode.sbatch"), env=env,
    )  # fmt: skip
    assert cluster.wait(job, 600) == {job: "COMPLETED"}, _outputs(folder)
    [row] = _rows(out)
    assert row["status"] == "ok" and row["world_size"] == 2 and row["nodes"] == 2, row["error"]
    # The sweep planned the cell as two nodes of one rank (sweep_skip.predicted_cell_oom) and said it fits, as it
    # did (bench/cluster_network.py holds the plan's memory and NVMe per node to what such a cell used).
    assert "predicted OOM" not in "".join(_outputs(folder).values())
    hosts = _hosts(os.path.join(out, f"hostfile.{job}"))
    assert len(hosts) == 2 and row["machine"]["host"] == hosts[0]
    with open(os.path.join(out, "cells", row["key"], "stdout.log")) as f:
        log = f.read()
    if launcher == "pdsh":
        assert f"cmd = pdsh -S -f 1024 -w {','.join(hosts)} " in log
        assert f"{hosts[1]}: " in log and "nnodes=2, num_local_procs=1, node_rank=1" in log
    else:
        assert f"cmd = srun -n 2 --nodelist {','.join(hosts)} --nodes 2 " in log
    # Each node made the cell's swap root in its own local folder (the second with --create-nvme-path).
    for h in hosts:
        assert os.path.isdir(os.path.join(cluster.dir, "nodes", h, "local", swap)), h
    _LOSSES[launcher] = row["losses"]
    if len(_LOSSES) == 2:
        assert _LOSSES["pdsh"] == pytest.approx(_LOSSES["slurm"], rel=1e-6)


_LOSSES = {}
