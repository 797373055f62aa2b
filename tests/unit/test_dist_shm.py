"""Finding and removing the /dev/shm segments DeepSpeed's CPU communicator leaves behind."""

import mmap
import os
import time

import pytest

from aidaptiv_ds.zero3 import dist_shm


def _segment(shm_dir, port, rank, age_s=0.0, size=4096):
    path = dist_shm.own_segment(rank, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, str(shm_dir))
    with open(path, "wb") as f:
        f.write(b"\0" * size)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def test_names_follow_deepspeeds_shm_cpp(tmp_path):
    path = dist_shm.own_segment(1, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}, str(tmp_path))
    assert os.path.basename(path) == f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29611_1"


def test_release_unlinks_only_this_ranks_segment(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "30001"}
    mine, other = _segment(tmp_path, 30001, 0), _segment(tmp_path, 30001, 1)
    assert dist_shm.release_own_segment(0, env, str(tmp_path)) is True
    assert not os.path.exists(mine) and os.path.exists(other)
    assert dist_shm.release_own_segment(0, env, str(tmp_path)) is False  # nothing to release: no error


def test_a_segment_that_cannot_be_removed_is_a_warning_not_an_error(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "30005"}
    path = _segment(tmp_path, 30005, 0)
    os.unlink(path)
    os.mkdir(path)  # unlink() of a directory fails with EISDIR (or EPERM): stands in for any other error
    with pytest.warns(RuntimeWarning, match="could not remove DeepSpeed's shared-memory segment"):
        assert dist_shm.release_own_segment(0, env, str(tmp_path)) is False


def test_stale_means_old_and_mapped_by_no_live_process(tmp_path):
    old = _segment(tmp_path, 30002, 0, age_s=3600, size=8192)
    young = _segment(tmp_path, 30003, 0)
    in_use = _segment(tmp_path, 30004, 0, age_s=3600)
    (tmp_path / "unrelated_old_file").write_bytes(b"x")
    os.utime(tmp_path / "unrelated_old_file", (0, 0))
    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a live job still maps this one
        assert dist_shm.stale_segments(600, str(tmp_path)) == [(old, 8192)]
        assert dist_shm.remove_stale_segments(600, str(tmp_path)) == (1, 8192)
    assert not os.path.exists(old)
    assert os.path.exists(young) and os.path.exists(in_use)
    assert (tmp_path / "unrelated_old_file").exists()
    assert "1 shared-memory segment(s)" in dist_shm.describe_removed(1, 8192)
