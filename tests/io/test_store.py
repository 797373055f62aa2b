"""Swap space and store: privacy rules, extents, hazards between requests, the host budget."""

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from engine_helpers import REPO_ROOT, run_child

from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.swap.host_memory import (
    HostBudgetError,
    HostMemory,
    WriteBehind,
    aligned_empty,
)
from aidaptiv_ds.swap.space import SwapSpace, SwapSpaceInUseError
from aidaptiv_ds.swap.store import ALIGN, SwapStore


@pytest.fixture
def engine():
    e = IOEngine(backend="auto")
    yield e
    e.shutdown()


def test_directory_and_files_are_private_and_removed_at_close(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=3)
    # The runtime's own folder inside the rank's (locked) folder.
    assert os.path.dirname(space.path) == os.path.join(str(tmp_path), "aidaptiv-swap", "rank3") == space.rank_path
    assert stat.S_IMODE(os.stat(space.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(space.rank_path).st_mode) == 0o700
    f = space.create_file("params.swp", engine)
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    assert space.close() == []
    assert not os.path.exists(os.path.join(str(tmp_path), "aidaptiv-swap"))


def test_sub_folders_are_private_and_removed_at_close(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    sub = space.make_subdir("handed-out")
    assert sub == os.path.join(space.path, "handed-out") and stat.S_IMODE(os.stat(sub).st_mode) == 0o700
    with open(os.path.join(sub, "copied"), "wb") as fh:
        fh.write(b"x")
    for bad in ("a/b", "..", ""):
        with pytest.raises(ValueError):
            space.make_subdir(bad)
    assert space.close() == []
    assert not os.path.exists(os.path.join(str(tmp_path), "aidaptiv-swap"))


def test_kept_files_are_listed(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0, keep_files=True)
    f = space.create_file("params.swp", engine)
    assert space.close() == [f.path] and os.path.exists(f.path)


def test_symlinked_swap_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "aidaptiv-swap").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError) as e:
        SwapSpace(str(tmp_path), rank=0)
    assert "symbolic link" in str(e.value)


def test_another_users_file_is_never_reused(tmp_path, engine):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    space = SwapSpace(str(tmp_path), rank=0)
    victim = os.path.join(space.path, "params.swp")
    open(victim, "w").close()
    os.chown(victim, 65534, 65534)
    with pytest.raises(PermissionError) as e:
        space.create_file("params.swp", engine)
    assert "belongs to uid 65534" in str(e.value)


HOLD_A_SPACE = """
    import os, sys, time
    from aidaptiv_ds.engine.io import IOEngine
    from aidaptiv_ds.swap.space import SwapSpace
    engine = IOEngine(backend="posix")
    space = SwapSpace({root!r}, rank=0)
    f = space.create_file("params.swp", engine)
    f.allocate(8192)
    print(space.path, flush=True)
    {then}
"""


def _hold_in_child(root, then):
    """A child process that opens a swap space under ``root`` and prints its folder, then runs ``then``."""
    code = textwrap.dedent(HOLD_A_SPACE).format(root=str(root), then=then)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/"
    )
    line = child.stdout.readline().strip()
    assert line, child.stderr.read()
    return child, line


def test_a_second_job_on_the_same_path_and_rank_is_refused_naming_the_holder(tmp_path, engine):
    child, held = _hold_in_child(tmp_path, "time.sleep(60)")
    try:
        with pytest.raises(SwapSpaceInUseError) as e:
            SwapSpace(str(tmp_path), rank=0)
        msg = str(e.value)
        assert f"pid {child.pid} " in msg and "in use by another job" in msg and "nvme_path" in msg
        assert e.value.errno == errno.EBUSY
        # Refused without touching the holder's files.
        assert os.path.getsize(os.path.join(held, "params.swp")) > 0
        # Another rank on the same path is another folder, another lock.
        other = SwapSpace(str(tmp_path), rank=1)
        other.close()
    finally:
        child.kill()
        child.wait()


def test_files_of_a_job_that_died_are_reclaimed_once_its_lock_is_free(tmp_path, engine):
    child, held = _hold_in_child(tmp_path, "os.kill(os.getpid(), 9)")
    child.wait(timeout=30)
    assert os.path.exists(os.path.join(held, "params.swp"))  # kill -9: nothing cleaned up
    space = SwapSpace(str(tmp_path), rank=0)  # its lock died with it
    assert not os.path.exists(held) and os.path.isdir(space.path)
    space.close()
    assert not os.path.exists(os.path.join(str(tmp_path), "aidaptiv-swap"))


def test_two_spaces_of_one_process_share_the_lock_and_never_each_others_files(tmp_path, engine):
    a = SwapSpace(str(tmp_path), rank=0)
    b = SwapSpace(str(tmp_path), rank=0)  # a second model built in the same process
    assert a.path != b.path and a.rank_path == b.rank_path
    fa, fb = a.create_file("params.swp", engine), b.create_file("params.swp", engine)
    buf = aligned_empty(ALIGN)
    buf.fill_(1)
    engine.write(buf, fa.handle, fa.allocate(ALIGN).offset)
    buf.fill_(2)
    engine.write(buf, fb.handle, fb.allocate(ALIGN).offset)
    b.close()
    assert os.path.exists(fa.path)  # the other space's close leaves these alone
    out = aligned_empty(ALIGN)
    engine.read(out, fa.handle, 0)
    assert bool((out == 1).all())
    # Still locked against other processes while one space of ours is open.
    child = run_child(f"""
        from aidaptiv_ds.swap.space import SwapSpace, SwapSpaceInUseError
        try:
            SwapSpace({str(tmp_path)!r}, rank=0)
            print("opened")
        except SwapSpaceInUseError:
            print("refused")
    """)
    assert child.stdout.strip() == "refused", child.stderr
    a.close()
    assert not os.path.exists(os.path.join(str(tmp_path), "aidaptiv-swap"))


def test_a_file_deleted_or_replaced_under_the_job_is_not_reopened_by_path(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    f = space.create_file("params.swp", engine)
    f.allocate(ALIGN)
    os.rename(f.path, f.path + ".moved")
    with open(f.path, "wb") as fh:  # what another run's create_file used to leave there
        fh.write(b"\0" * ALIGN)
    with IOEngine(backend="posix") as other:
        with pytest.raises(OSError) as e:
            f.reopen(other)
        assert "replaced by another file" in str(e.value) and e.value.filename == f.path
        os.unlink(f.path)
        with pytest.raises(OSError) as e:
            f.reopen(other)
        assert "was deleted" in str(e.value)
        os.rename(f.path + ".moved", f.path)
        f.reopen(other)  # the same file again: accepted
        assert f.engine is other
        space.close()


def test_swap_files_never_grow_past_the_file_size_limit_and_sigxfsz_is_left_alone(tmp_path):
    # Before: the runtime ignored SIGXFSZ for the whole process of a program that had set it to the
    # default. Now a swap file refuses to grow past ulimit -f (EFBIG, named), the process lives, and its
    # SIGXFSZ disposition is still the program's.
    out = run_child(f"""
        import errno, json, resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)   # a program that wants the default (CPython ignores it)
        from aidaptiv_ds.config.settings import SwapSettings
        from aidaptiv_ds.zero3.runtime import SwapRuntime
        import torch
        cfg = SwapSettings.from_block({{"enabled": True, "nvme_path": {str(tmp_path)!r}, "backend": "posix",
                                        "host_memory_budget": "64MiB"}})
        limit = 3 * 1048576 + 1000
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        rt = SwapRuntime(cfg, 0, torch.float32)
        got = {{}}
        try:
            rt.params_file.allocate(1 << 20)        # fits
            rt.params_file.allocate(4 << 20)        # would cross the limit
        except OSError as e:
            got = {{"errno": e.errno, "file": e.filename, "msg": str(e)}}
        got["size"] = rt.params_file.size
        got["disposition"] = str(signal.getsignal(signal.SIGXFSZ))
        rt.close()
        print(json.dumps(got))
    """)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["errno"] == errno.EFBIG and got["file"].endswith("params.swp") and "ulimit -f" in got["msg"]
    assert 1 << 20 <= got["size"] <= 3 * 1048576 + 1000
    assert got["disposition"] == str(signal.SIG_DFL)


def test_engine_writes_past_the_limit_fail_with_efbig_inside_the_block_only(tmp_path):
    # Inside runtime.writing() (a checkpoint save) a write past ulimit -f raises EFBIG; the same process
    # is still killed by SIGXFSZ for a write of its own outside it (the user's program is untouched).
    path = str(tmp_path / "ckpt.bin")
    out = run_child(f"""
        import json, os, resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)   # a program that wants the default (CPython ignores it)
        from aidaptiv_ds.config.settings import SwapSettings
        from aidaptiv_ds.zero3.runtime import SwapRuntime
        import torch
        cfg = SwapSettings.from_block({{"enabled": True, "nvme_path": {str(tmp_path)!r},
                                        "host_memory_budget": "64MiB"}})
        rt = SwapRuntime(cfg, 0, torch.float32)
        buf = torch.empty(4 << 20, dtype=torch.uint8)
        buf = buf[(-buf.data_ptr()) % 4096:][:2 << 20]
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with rt.writing():
            try:
                rt.engine.write(buf, {path!r}, 1 << 20)
                print("no error", flush=True)
            except OSError as e:
                print(json.dumps([e.errno, e.filename]), flush=True)
        rt.close()
        fd = os.open({path!r}, os.O_WRONLY)
        os.pwrite(fd, b"x", 2 << 20)                # the program's own write: SIGXFSZ as ever
        print("survived", flush=True)
    """)
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[0]) == [errno.EFBIG, path], out.stderr
    assert "survived" not in lines and out.returncode == -signal.SIGXFSZ


def test_extents_are_aligned_grow_the_file_and_are_reused(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    f = space.create_file("x.swp", engine)
    a, b = f.allocate(10), f.allocate(5000)
    assert (a.offset, a.reserved, b.offset, b.reserved) == (0, ALIGN, ALIGN, 2 * ALIGN)
    assert os.path.getsize(f.path) >= b.end  # preallocated
    f.release(a)
    assert f.allocate(100).offset == 0


def test_released_neighbours_merge_so_a_relocated_group_reuses_them(tmp_path, engine):
    # Layer groups relocated at start (LoRA adapters partitioned after the base, at the file's end) free their
    # partitions one by one; merged, two freed groups take the next, so the file does not double.
    space = SwapSpace(str(tmp_path), rank=0)
    f = space.create_file("x.swp", engine)
    parts = [f.allocate(4 * ALIGN) for _ in range(6)]  # three groups of two partitions
    end = f.allocated
    for p in (parts[1], parts[0], parts[3], parts[2]):  # out of order: merged both ways
        f.release(p)
    assert f._free == [(0, 16 * ALIGN)]
    group = f.allocate(12 * ALIGN)  # larger than any one partition or group freed
    assert group.offset == 0 and f.allocated == end  # reused, the file did not grow
    f.release(parts[5])  # the last extent: the live part of the file shortens instead (checkpoints copy it)
    assert f.allocated == 20 * ALIGN and f._free == [(12 * ALIGN, 4 * ALIGN)]
    f.release(group)
    assert f._free == [(0, 16 * ALIGN)]
    f.release(parts[4])  # joins the free extent before it, which now ends the live part: nothing is live
    assert f._free == [] and f.allocated == 0
    assert f.allocate(ALIGN).offset == 0


def test_read_after_write_and_write_after_read_are_ordered(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    store = SwapStore(engine, space)
    f = space.create_file("x.swp", engine)
    ext = f.allocate(8 << 20)
    for i in range(5):
        src = aligned_empty(ext.reserved)
        src.copy_(torch.randint(0, 256, (ext.reserved,), dtype=torch.uint8))
        store.write_span(f, ext.offset, src, "w")  # not waited for
        dst = aligned_empty(ext.reserved)
        store.wait(store.read_span(f, ext.offset, dst, "r"))  # must see the write above
        assert torch.equal(src, dst)
    store.drain()


def test_write_behind_counts_freeing_buffers_and_finishes_oldest_first(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    store = SwapStore(engine, space)
    f = space.create_file("x.swp", engine)
    ext = f.allocate(3 * ALIGN)
    wb = WriteBehind(store)
    bufs = [aligned_empty(ALIGN) for _ in range(3)]
    for i, (buf, frees) in enumerate(zip(bufs, (False, True, True))):
        buf.fill_(i + 1)
        wb.add(store.write_span(f, ext.offset + i * ALIGN, buf, f"w{i}"), buf, frees)
    assert wb.held_bytes() == 2 * ALIGN  # the first buffer is a view someone else owns
    waited = []
    # Finishing stops at the first write that frees memory: the non-freeing one before it goes too.
    assert wb.finish_oldest(after_each=lambda: waited.append(1)) and waited == [1, 1]
    assert wb.held_bytes() == ALIGN
    wb.finish_all(threading.Lock())
    assert wb.held_bytes() == 0 and not wb.finish_oldest() and not wb.forget_finished()
    back = aligned_empty(3 * ALIGN)
    store.wait(store.read_span(f, ext.offset, back, "r"))
    assert [int(back[i * ALIGN]) for i in range(3)] == [1, 2, 3]
    store.drain()


def test_budget_is_enforced_reclaimers_run_and_the_error_says_what_holds_memory():
    pool = PinnedPool(4 << 20)
    mem = HostMemory(pool)
    held = [mem.take(3 << 20, "a")]
    freed = []

    def reclaim():
        if held:
            freed.append(held.pop())
            freed.clear()
            return True
        return False

    mem.add_reclaimer("test buffers", reclaim)
    mem.add_holder("test buffers", lambda: sum(t.numel() for t in held))
    buf = mem.take(2 << 20, "b")  # only fits once the reclaimer gave its 3 MiB back
    assert buf.numel() == 2 << 20
    with pytest.raises(HostBudgetError) as e:
        mem.take(3 << 20, "c")
    assert "c needs 3.0 MiB" in str(e.value) and "test buffers" in str(e.value)
    assert "host_memory_budget" in str(e.value)
    assert "still referenced elsewhere 2.0 MiB" in str(e.value)  # ``buf``: no holder owns it
    assert mem.try_take(3 << 20) is None  # non-blocking: no costly reclaimers, no error


def test_a_full_budget_raises_nothing_inside_the_engine(monkeypatch):
    """A full pool is routine for the swapper: take asks, reclaims, asks again. On an H100 a training process
    died of SIGSEGV at its first C++ OutOfPinnedMemory (bench/results/gpu_probe/h100), so that path must not
    throw at all, in C++ either: HostMemory asks with try_allocate, which answers None."""
    pool = PinnedPool(64 << 10)
    mem = HostMemory(pool)
    raised = []
    real = PinnedPool.allocate

    def allocate(self, *args, **kwargs):
        try:
            return real(self, *args, **kwargs)
        except MemoryError as e:
            raised.append(e)
            raise

    monkeypatch.setattr(PinnedPool, "allocate", allocate)
    held = mem.take(64 << 10, "all of it")
    assert mem.try_take(4096) is None and mem.try_take(4096, large=True) is None
    with pytest.raises(HostBudgetError):
        mem.take(4096, "one more")
    assert raised == []
    del held
    assert mem.try_take(4096) is not None  # the block came back
    # try_allocate itself: None past the budget, a tensor of the pool otherwise, and allocate still raises.
    assert pool.try_allocate(1 << 20) is None
    t = pool.try_allocate(1000, torch.float32, from_top=True)
    assert t.dtype == torch.float32 and t.numel() == 1000 and pool.contains(t)
    with pytest.raises(MemoryError, match="pinned pool cannot hand out 1048576 bytes"):
        real(pool, 1 << 20)


def test_a_swap_file_truncated_under_the_job_is_an_error_not_zeros(tmp_path, engine):
    # A write after the truncation extends the file again with a hole before it: a read there would give
    # zeros without an error from the kernel. The store checks the size against what it preallocated.
    space = SwapSpace(str(tmp_path), rank=0)
    store = SwapStore(engine, space)
    f = space.create_file("params.swp", engine)
    a, b = f.allocate(ALIGN), f.allocate(ALIGN)
    buf = aligned_empty(ALIGN)
    buf.fill_(3)
    store.wait(store.write_span(f, a.offset, buf))
    os.truncate(f.path, 0)
    with pytest.raises(OSError) as e:
        store.write_span(f, b.offset, buf)
    assert e.value.errno == errno.ENODATA and "truncated under the job" in str(e.value) and e.value.filename == f.path
    with pytest.raises(OSError):
        store.read_span(f, a.offset, aligned_empty(ALIGN))
    space.close()


def test_a_disk_with_less_free_than_a_growth_step_still_holds_what_is_needed(tmp_path, engine, monkeypatch):
    """Swap files grow 256 MiB ahead; on a disk with less free than that but enough for the state (as the
    planner counts it) the file grows by what is needed instead of failing, and when even that does not fit
    the error gives the free space measured before the attempt, not what a failed fallocate left."""
    import aidaptiv_ds.swap.space as space_module

    free = {"bytes": 64 << 20, "kept": 0}
    real_fallocate, real_ftruncate = os.posix_fallocate, os.ftruncate

    def small_disk(fd, offset, length):
        if length > free["bytes"]:
            free["kept"], free["bytes"] = free["bytes"], 0  # a failed fallocate keeps what it took past the end
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fallocate(fd, offset, length)
        free["bytes"] -= length

    def truncate(fd, length):  # cutting the file back to its size gives those blocks back
        free["bytes"], free["kept"] = free["bytes"] + free["kept"], 0
        real_ftruncate(fd, length)

    monkeypatch.setattr(space_module.os, "posix_fallocate", small_disk)
    monkeypatch.setattr(space_module.os, "ftruncate", truncate)
    space = SwapSpace(str(tmp_path), rank=0)
    f = space.create_file("params.swp", engine)
    extent = f.allocate(8 << 20)  # 8 MiB where the growth step would be 256 MiB
    assert extent.offset == 0 and f.size == 8 << 20
    free["bytes"] = 4 << 20
    with pytest.raises(OSError, match=r"No space left on device; the filesystem had [0-9.]+ GiB free before") as e:
        f.allocate(16 << 20)
    assert e.value.errno == errno.ENOSPC and f.path in str(e.value)
    space.close()
