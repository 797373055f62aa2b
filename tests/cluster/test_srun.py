"""`srun python -m aidaptiv_ds train` on a real SLURM controller (tests/cluster/conftest.py): the ranks take
RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT from the variables srun sets (aidaptiv_ds.job.rank_env).
Two nodes of one rank each give the losses of two ranks on one node, and each rank swaps only in its own
node's local folder."""

import json
import os

import pytest
from helpers import CONFIGS, failure_excerpt, read_metrics

TRAIN = ["python", "-m", "aidaptiv_ds", "train", "--model", "micro", "--steps", "3", "--warmup", "1"]
TRAIN += ["--seq-len", "64", "--no-progress", "--create-nvme-path"]


def _config(folder):
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    cfg["aidaptiv"]["keep_swap_files"] = True  # to see afterwards which rank swapped on which node
    path = os.path.join(folder, "aidaptiv_keep.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _rank_folders(cluster, node, swap):
    base = os.path.join(cluster.dir, "nodes", node, "local", swap, "aidaptiv-swap")
    return sorted(os.listdir(base)) if os.path.isdir(base) else []


def test_srun_two_nodes_match_two_ranks_on_one_node(cluster):
    folder = os.path.join(cluster.shared, "srun")
    os.makedirs(folder)
    config = _config(folder)
    runs = {}
    for name, shape in (("one", ["-N1", "-n2", "--cpus-per-task=1"]), ("two", ["-N2", "--ntasks-per-node=1"])):
        swap = f"srun-{name}"
        r = cluster.run(
            "srun", *shape, "--nodelist=node3,node4" if name == "two" else "--nodelist=node3",
            *TRAIN, "--config", config, "--nvme-path", os.path.join(cluster.local, swap),
            "--metrics-out", os.path.join(folder, f"{name}.json"),
            cwd=folder, timeout=600, check=False,
        )  # fmt: skip
        assert r.returncode == 0, failure_excerpt(r.stdout + r.stderr)
        runs[name] = read_metrics(os.path.join(folder, f"{name}.json"))
        assert runs[name]["status"] == "ok" and runs[name]["world_size"] == 2
    assert _rank_folders(cluster, "node3", "srun-one") == ["rank0", "rank1"]
    # Global rank r swaps under its own node's folder and nowhere else.
    assert [_rank_folders(cluster, n, "srun-two") for n in ("node3", "node4")] == [["rank0"], ["rank1"]]
    assert runs["two"]["losses"] == pytest.approx(runs["one"]["losses"], rel=1e-6)
