"""Two ranks under DeepSpeed's own launcher (gloo on CPU)."""

import glob
import math
import os

import pytest
from helpers import CONFIGS, failure_excerpt, read_metrics, run_train

from aidaptiv_ds.zero3 import dist_shm
from aidaptiv_ds.zero3.compat import SHM_ALLREDUCE_PREFIX

COMMON = ["--model", "micro", "--steps", "3", "--warmup", "1", "--seq-len", "64", "--no-progress"]


@pytest.fixture(scope="module")
def one_rank_batch4(tmp_path_factory):
    """The same data as 2 ranks x micro-batch 2, seen by one rank with micro-batch 4."""
    cwd = tmp_path_factory.mktemp("one_rank")
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "zero3.json"),
            *COMMON,
            "--micro-batch",
            "4",
            "--metrics-out",
            str(cwd / "m.json"),
        ],
        cwd=cwd,
    )
    assert rc == 0, log[-3000:]
    return read_metrics(cwd / "m.json")


def launch(tmp_path, config, extra=()):
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, config),
            *COMMON,
            "--nvme-path",
            str(tmp_path / "swap"),
            "--metrics-out",
            str(tmp_path / "m.json"),
            *extra,
        ],
        cwd=tmp_path,
        launcher_procs=2,
    )
    return rc, log


def _allreduce_segments():
    return set(glob.glob(os.path.join(dist_shm.SHM_DIR, SHM_ALLREDUCE_PREFIX + "_*")))


def test_zero3_two_ranks_matches_one_rank_with_the_same_data(tmp_path, one_rank_batch4):
    before = _allreduce_segments()
    rc, log = launch(tmp_path, "zero3.json")
    # DeepSpeed's CPU communicator made a 66 MiB /dev/shm segment per rank; none may outlive the run.
    assert _allreduce_segments() - before == set()
    assert rc == 0, failure_excerpt(log)
    m = read_metrics(tmp_path / "m.json")
    assert m["status"] == "ok" and m["world_size"] == 2 and m["micro_batch"] == 2
    assert m["tokens_per_step"] == 2 * 2 * 64
    # Rank 0 prints the summary; rank 1 prints nothing of its own.
    assert log.count("aidaptiv-ds train: status=ok") == 1
    # Losses are averaged over ranks, and the 2 shards together are the 1-rank batch of 4.
    assert m["losses"] == pytest.approx(one_rank_batch4["losses"], rel=1e-5)


@pytest.mark.slow
def test_zero_infinity_two_ranks(tmp_path, one_rank_batch4):
    rc, log = launch(tmp_path, "zero_infinity.json", ["--keep-swap"])
    assert rc == 0, failure_excerpt(log)
    m = read_metrics(tmp_path / "m.json")
    assert m["status"] == "ok" and m["world_size"] == 2 and m["backend"] == "zero_infinity"
    assert all(math.isfinite(x) for x in m["losses"])
    assert m["losses"] == pytest.approx(one_rank_batch4["losses"], rel=1e-4)
    # Both ranks swap: each has its own folder, and the bytes are summed over ranks.
    params = tmp_path / "swap" / "zero_stage_3" / "float32params"
    assert sorted(p.name for p in params.iterdir()) == ["rank0", "rank1"]
    assert m["nvme_read_bytes"] > 0 and m["nvme_write_bytes"] > 0
