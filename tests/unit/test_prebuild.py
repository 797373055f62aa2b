"""The sweep's op prebuild warns about build locks a killed compile left behind (torch waits on them forever)."""
import os
import time

from aidaptiv_ds.harness.prebuild import stale_locks


def test_old_lock_files_are_reported_and_fresh_ones_are_not(tmp_path):
    old = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    fresh = tmp_path / "py311_cpu" / "async_io" / "lock"
    for p in (old, fresh):
        p.parent.mkdir(parents=True)
        p.touch()
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    assert stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == [str(old)]
    assert stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path / "missing")}) == []
