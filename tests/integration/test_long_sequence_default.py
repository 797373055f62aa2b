"""The shipped config trains a long sequence under a memory cap without naming an activation policy: the train
job runs a block without one with policy "auto", which plans the activations from the memory the process may
use (the cgroup's limit included), where keeping every activation is killed by the cap. The full-size case (tiny at 12,000 tokens under 5 GiB) is
bench/long_sequence.py's; this is a shorter cell of the same path."""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import CONFIGS, child_env

from aidaptiv_ds.harness.hostcap import probe_cgroup

FACTORY, WHERE = probe_cgroup()
pytestmark = pytest.mark.skipif(FACTORY is None, reason=f"needs a memory cgroup to cap the job: {WHERE}")

CAP = int(3.5 * (1 << 30))
SEQ = 8000


def _train(tmp_path, name, policy=None):
    cfg = json.load(open(os.path.join(CONFIGS, "aidaptiv.json")))
    assert "activations" not in cfg["aidaptiv"]  # shipped: no policy named (the train job plans with "auto")
    swap = tmp_path / f"swap_{name}"
    swap.mkdir()
    cfg["aidaptiv"]["nvme_path"] = str(swap)
    if policy:
        cfg["aidaptiv"]["activations"] = {"policy": policy}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "aidaptiv_ds", "train", "--config", str(path), "--model", "tiny", "--seq-len",
           str(SEQ), "--micro-batch", "1", "--steps", "1", "--warmup", "0", "--no-progress"]  # fmt: skip
    cg = FACTORY.create(f"aidaptiv-test-longseq-{os.getpid()}-{name}-{int(time.time())}", CAP)
    try:
        # One process, 8000 tokens: compute-bound, so both cores (130 s for the test, 145 s with child_env's one thread).
        env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        p = subprocess.run(cg.wrap(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        return p.returncode, p.stdout + p.stderr, cg.oom_kills()
    finally:
        cg.remove()


@pytest.mark.long("bench/long_sequence.py runs it; the nvme policy's losses: test_activations.py")
def test_shipped_config_trains_a_long_sequence_under_a_cap_where_keep_is_killed(tmp_path):
    rc, log, ooms = _train(tmp_path, "keep", policy="keep")
    assert rc != 0 and ooms >= 1, log[-2000:]
    rc, log, ooms = _train(tmp_path, "shipped")
    assert rc == 0 and ooms == 0, log[-3000:]
    plan = next(line for line in log.splitlines() if "activations auto:" in line)
    assert "this rank's host_memory_budget" in plan and ("stored on NVMe" in plan or "recomputed" in plan), plan
    assert "status=ok" in log
