"""Two nodes of one rank each, on this machine: two deepspeed launcher invocations with --no_ssh and a
hostfile of two hosts (what each node of a real job runs, node ranks 0 and 1), gloo on CPU. Each node has
its own swap disk (here two folders) and each rank swaps only there; the losses are those of the same job
run as two ranks on one node."""

import json
import os
import subprocess
import sys

import pytest
from helpers import (
    CONFIGS,
    _free_port,
    child_env,
    failure_excerpt,
    read_metrics,
    run_train,
)

COMMON = ["--model", "micro", "--steps", "3", "--warmup", "1", "--seq-len", "64", "--no-progress"]
# Two ranks' gradients are summed in the same order whichever way they are connected (shared memory on one
# node, gloo over TCP across nodes): the losses agree to fp32 rounding.
LOSS_REL = 1e-6


def _config(tmp_path):
    """aidaptiv.json with the swap files kept, so that which rank swapped where can be seen afterwards."""
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    cfg["aidaptiv"]["keep_swap_files"] = True
    path = tmp_path / "aidaptiv_keep.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _rank_folders(swap):
    base = swap / "aidaptiv-swap"
    return sorted(p.name for p in base.iterdir() if p.is_dir() and any(p.iterdir())) if base.is_dir() else []


@pytest.fixture(scope="module")
def one_node_two_ranks(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("one_node")
    (cwd / "swap").mkdir()
    rc, log = run_train(
        ["--config", _config(cwd), *COMMON, "--nvme-path", str(cwd / "swap"), "--metrics-out", str(cwd / "m.json")],
        cwd=cwd,
        launcher_procs=2,
    )
    assert rc == 0, failure_excerpt(log)
    assert _rank_folders(cwd / "swap") == ["rank0", "rank1"]
    return read_metrics(cwd / "m.json")


@pytest.mark.long("tests/cluster/ runs two nodes for real (srun, pdsh, slurm)")
def test_two_nodes_no_ssh_match_one_node(tmp_path, one_node_two_ranks):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")  # names only: --no_ssh never resolves them
    config, port = _config(tmp_path), str(_free_port())
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    nodes = []
    for node in (0, 1):
        swap = tmp_path / f"node{node}_nvme"  # each node's own disk, given as the same flag on every node
        # Node 1 lacks its folder, as a sweep's cell folder is made on the first node only: --create-nvme-path.
        make = ["--create-nvme-path"] if node == 1 else []
        if not make:
            swap.mkdir()
        cmd = [
            deepspeed,
            "--no_ssh",
            "--node_rank",
            str(node),
            "--hostfile",
            str(hostfile),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "--no_local_rank",
            "--module",
            "aidaptiv_ds",
            "train",
            "--config",
            config,
            *COMMON,
            "--nvme-path",
            str(swap),
            *make,
            "--metrics-out",
            str(tmp_path / "m.json"),
        ]
        nodes.append(
            (
                swap,
                subprocess.Popen(
                    cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                ),
            )
        )
    logs = [p.communicate(timeout=600)[0] for _, p in nodes]
    for (_, p), log in zip(nodes, logs):
        assert p.returncode == 0, failure_excerpt(log)
    m = read_metrics(tmp_path / "m.json")
    assert m["status"] == "ok" and m["world_size"] == 2 and m["tokens_per_step"] == 2 * 2 * 64
    # Rank 0 (node 0) prints the summary and writes the metrics; node 1's rank prints no summary of its own.
    assert "aidaptiv-ds train: status=ok" in logs[0] and "status=" not in logs[1]
    assert m["losses"] == pytest.approx(one_node_two_ranks["losses"], rel=LOSS_REL)
    # Global rank r swaps under <its node's nvme_path>/aidaptiv-swap/rank<r> and nowhere else.
    assert [_rank_folders(swap) for swap, _ in nodes] == [["rank0"], ["rank1"]]
    assert (nodes[1][0].stat().st_mode & 0o777) == 0o700
