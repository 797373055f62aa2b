"""A node lost in the middle of a two-node `--save-every` job on the real SLURM cluster (tests/cluster/
conftest.py): every process of one node is killed (slurmd, its job step, its rank, sshd). The surviving rank
fails at once on gloo's broken connection and names the rank it lost and its node, srun --kill-on-bad-exit ends the
step and the job ends with a non-zero code within a bounded time. The job submitted again on another pair of
nodes with `--resume auto` continues from the last complete checkpoint in the shared --save-dir (every
rank's files, aidaptiv/rank<r> included, are written there) and gives the losses of an uninterrupted run."""

import os
import shlex
import time

import pytest
from helpers import CONFIGS, read_metrics

STEPS = 8
TRAIN = ["python", "-m", "aidaptiv_ds", "train", "--config", os.path.join(CONFIGS, "aidaptiv.json")]
TRAIN += ["--model", "micro", "--steps", str(STEPS), "--warmup", "1", "--seq-len", "64", "--no-progress"]
TRAIN += ["--create-nvme-path", "--save-every", "2"]
# From the kill to the job's end: the survivor's gloo read fails at once (the killed rank's socket is reset),
# srun --kill-on-bad-exit ends the step; the rest is SLURM's bookkeeping (SlurmdTimeout=30 marks the node down).
BOUND_S = 90


def _submit(cluster, folder, name, nodes, save_dir, *extra):
    """The job as a batch script running srun. --no-requeue: SLURM would otherwise requeue it on the node
    failure (JobRequeue=1), and this test resubmits it on other nodes itself."""
    train = [*TRAIN, "--nvme-path", os.path.join(cluster.local, f"loss-{name}"), "--save-dir", save_dir]
    train += ["--metrics-out", os.path.join(folder, f"{name}.json"), *extra]
    return cluster.sbatch(
        "--no-requeue", "-N2", "--ntasks-per-node=1", f"--nodelist={nodes}", f"--output={folder}/{name}.out", f"--chdir={folder}",
        "--wrap", "srun --kill-on-bad-exit=1 " + shlex.join(train),
    )  # fmt: skip


def _text(path):
    with open(path) as f:
        return f.read()


def _latest(save_dir):
    try:
        return _text(os.path.join(save_dir, "latest")).strip()
    except FileNotFoundError:
        return ""


def test_node_lost_mid_run_then_resumed_on_other_nodes(cluster):
    folder = os.path.join(cluster.shared, "node-loss")
    os.makedirs(folder)
    ck = os.path.join(folder, "ck")
    # The uninterrupted job on node3+node4, the one to lose a node on node1+node2, at the same time.
    full = _submit(cluster, folder, "full", "node3,node4", os.path.join(folder, "full-ck"))
    lossy = _submit(cluster, folder, "lossy", "node1,node2", ck)
    try:
        deadline = time.monotonic() + 400
        while _latest(ck) not in ("step4", "step6") and time.monotonic() < deadline:
            assert cluster.states(lossy).get(lossy) in ("PENDING", "RUNNING", "CONFIGURING"), _text(
                f"{folder}/lossy.out"
            )
            time.sleep(0.2)
        assert _latest(ck) in ("step4", "step6"), f"no checkpoint after 400 s:\n{_text(f'{folder}/lossy.out')}"
        killed = time.monotonic()
        cluster.cluster("lose", "node2", "kill")
        state = cluster.wait(lossy, BOUND_S)[lossy]
        ended_s = time.monotonic() - killed
    finally:
        cluster.cluster("revive", "node2")
    log = _text(f"{folder}/lossy.out")
    assert state in ("FAILED", "NODE_FAIL"), (state, log)
    assert ended_s < BOUND_S
    exit_code = cluster.run("scontrol", "-o", "show", "job", lossy).stdout.split("ExitCode=")[1].split()[0]
    assert exit_code != "0:0", log
    # The survivor (rank 0 on node1) names the rank it lost and that rank's node.
    assert "aidaptiv-ds train: status=error error=lost rank 1 on node2 (10.231.0.12)" in log, log
    assert "node1: task 0: Exited with exit code 1" in log, log
    assert not os.path.exists(f"{folder}/lossy.json") or read_metrics(f"{folder}/lossy.json")["status"] != "ok"

    assert cluster.wait(full, 400) == {full: "COMPLETED"}, _text(f"{folder}/full.out")
    reference = read_metrics(f"{folder}/full.json")
    # Submitted again on node3+node4: the last complete checkpoint, every rank's part of it in the shared folder.
    resumed = _submit(cluster, folder, "resumed", "node3,node4", ck, "--resume", "auto")
    assert cluster.wait(resumed, 400) == {resumed: "COMPLETED"}, _text(f"{folder}/resumed.out")
    m = read_metrics(f"{folder}/resumed.json")
    assert m["status"] == "ok" and m["first_step"] in (4, 6) and len(m["losses"]) == STEPS
    assert f"the latest checkpoint in {ck} is" in _text(f"{folder}/resumed.out")
    assert m["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
