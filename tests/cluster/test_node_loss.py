"""Nodes lost in the middle of a two-node `--save-every` job on the real SLURM cluster (tests/cluster/
conftest.py), twice, and the job resumed each time on another pair of nodes:

1. every process of one node is killed (slurmd, its job step, its rank, sshd): the surviving rank fails at once on
   gloo's broken connection and names the rank it lost and its node;
2. the job, resumed on two other nodes, has a node's link cut: its processes run on, unreachable and silent, and
   the survivor gives up after `--peer-timeout` (which train passes to the process group) saying whom it waited
   for, instead of after torch's 30 minutes.

Each time srun --kill-on-bad-exit ends the step and the job ends with a non-zero code within a bounded time. The
job submitted again with `--resume auto` continues from the last complete checkpoint in the shared --save-dir
(every rank's files, aidaptiv/rank<r> included, are written there); the last one ends with the losses of an
uninterrupted run."""

import os
import shlex
import time

import pytest
from helpers import CONFIGS, read_metrics

STEPS = 12
# Below SLURM's own detection: the controller pings every SlurmdTimeout/3 = 10 s and marks a node down that has
# not answered for SlurmdTimeout = 30 s, which cancels the step, so a cut node's job may end 20 s after the cut.
# The survivor must have given up and said why before that.
PEER_TIMEOUT_S = 12
TRAIN = ["python", "-m", "aidaptiv_ds", "train", "--config", os.path.join(CONFIGS, "aidaptiv.json")]
TRAIN += ["--model", "micro", "--steps", str(STEPS), "--warmup", "1", "--seq-len", "64", "--no-progress"]
TRAIN += ["--create-nvme-path", "--save-every", "2", "--peer-timeout", str(PEER_TIMEOUT_S)]
# From the loss to the job's end: the survivor's gloo read fails at once when the lost rank's socket is reset (a
# kill), or after PEER_TIMEOUT_S when nothing answers (a cut link); srun --kill-on-bad-exit ends the step; the
# rest is SLURM's bookkeeping (SlurmdTimeout=30 marks the node down).
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


def _lose_mid_run(cluster, folder, name, job, ck, past, node, how):
    """Wait until the job has a checkpoint after step ``past``, lose ``node`` (cluster.sh lose NODE HOW), revive
    it once the job has ended; return (the job's state, seconds from the loss to the job's end, its log)."""
    deadline = time.monotonic() + 400
    while _step(_latest(ck)) <= past and time.monotonic() < deadline:
        assert cluster.states(job).get(job) in ("PENDING", "RUNNING", "CONFIGURING"), _text(f"{folder}/{name}.out")
        time.sleep(0.2)
    assert _step(_latest(ck)) > past, f"no checkpoint after step {past} in 400 s:\n{_text(f'{folder}/{name}.out')}"
    lost = time.monotonic()
    cluster.cluster("lose", node, how)
    try:
        state = cluster.wait(job, BOUND_S)[job]
        ended_s = time.monotonic() - lost
    finally:
        cluster.cluster("revive", node)
    return state, ended_s, _text(f"{folder}/{name}.out")


def _step(tag):
    return int(tag.removeprefix("step")) if tag else 0


def _failed(cluster, folder, name, job, state, ended_s, log):
    assert state in ("FAILED", "NODE_FAIL"), (state, log)
    assert ended_s < BOUND_S
    exit_code = cluster.run("scontrol", "-o", "show", "job", job).stdout.split("ExitCode=")[1].split()[0]
    assert exit_code != "0:0", log
    assert not os.path.exists(f"{folder}/{name}.json") or read_metrics(f"{folder}/{name}.json")["status"] != "ok"


def test_node_lost_mid_run_then_resumed_on_other_nodes(cluster):
    folder = os.path.join(cluster.shared, "node-loss")
    os.makedirs(folder)
    ck = os.path.join(folder, "ck")
    # The uninterrupted job on node3+node4, the one to lose a node on node1+node2, at the same time.
    full = _submit(cluster, folder, "full", "node3,node4", os.path.join(folder, "full-ck"))
    lossy = _submit(cluster, folder, "lossy", "node1,node2", ck)
    state, ended_s, log = _lose_mid_run(cluster, folder, "lossy", lossy, ck, 2, "node2", "kill")
    _failed(cluster, folder, "lossy", lossy, state, ended_s, log)
    # The survivor (rank 0 on node1) names the rank it lost and that rank's node.
    assert "aidaptiv-ds train: status=error error=lost rank 1 on node2 (10.231.0.12)" in log, log
    assert "node1: task 0: Exited with exit code 1" in log, log
    first_loss = _step(_latest(ck))

    assert cluster.wait(full, 400) == {full: "COMPLETED"}, _text(f"{folder}/full.out")
    reference = read_metrics(f"{folder}/full.json")
    # Submitted again on node3+node4 from the last complete checkpoint, every rank's part of it in the shared
    # folder; node4's link is cut once it has saved again.
    cut = _submit(cluster, folder, "cut", "node3,node4", ck, "--resume", "auto")
    state, ended_s, log = _lose_mid_run(cluster, folder, "cut", cut, ck, first_loss, "node4", "link")
    _failed(cluster, folder, "cut", cut, state, ended_s, log)
    assert f"the latest checkpoint in {ck} is {ck}/step{first_loss}" in log, log
    assert ended_s >= PEER_TIMEOUT_S - 2, ended_s  # it waited for the silent peer, then gave up
    said = f"error=no answer from the other ranks for {PEER_TIMEOUT_S} s (--peer-timeout): one of them, its node "
    said += "or the link to it went away (rank 1 on node4 (10.231.0.14))"
    assert said in log, log

    # And again on node1+node2: to the end, with the losses of the uninterrupted run.
    resumed = _submit(cluster, folder, "resumed", "node1,node2", ck, "--resume", "auto")
    assert cluster.wait(resumed, 400) == {resumed: "COMPLETED"}, _text(f"{folder}/resumed.out")
    m = read_metrics(f"{folder}/resumed.json")
    assert m["status"] == "ok" and m["first_step"] > first_loss and len(m["losses"]) == STEPS
    assert f"the latest checkpoint in {ck} is" in _text(f"{folder}/resumed.out")
    assert m["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
