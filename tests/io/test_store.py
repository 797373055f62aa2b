"""Swap space and store: privacy rules, extents, hazards between requests, the host budget."""
import os
import stat
import threading

import pytest
import torch

from aidaptiv_ds.io import IOEngine, PinnedPool
from aidaptiv_ds.store import (ALIGN, HostBudgetError, HostMemory, SwapSpace, SwapStore, WriteBehind,
                             aligned_empty)


@pytest.fixture
def engine():
    e = IOEngine(backend="auto")
    yield e
    e.shutdown()


def test_directory_and_files_are_private_and_removed_at_close(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=3)
    assert space.path == os.path.join(str(tmp_path), "aidaptiv-swap", "rank3")
    assert stat.S_IMODE(os.stat(space.path).st_mode) == 0o700
    f = space.create_file("params.swp", engine)
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    assert space.close() == []
    assert not os.path.exists(os.path.join(str(tmp_path), "aidaptiv-swap"))


def test_sub_folders_are_private_and_removed_at_close(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    sub = space.make_subdir("handed-out")
    assert sub == os.path.join(space.path, "handed-out") and stat.S_IMODE(os.stat(sub).st_mode) == 0o700
    (tmp_path / "aidaptiv-swap" / "rank0" / "handed-out" / "copied").write_bytes(b"x")
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


def test_stale_file_of_ours_is_replaced(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    stale = os.path.join(space.path, "params.swp")
    with open(stale, "wb") as fh:
        fh.write(b"x" * 10000)
    f = space.create_file("params.swp", engine)
    assert os.path.getsize(f.path) == 0  # a fresh file, created with O_EXCL


def test_extents_are_aligned_grow_the_file_and_are_reused(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    f = space.create_file("x.swp", engine)
    a, b = f.allocate(10), f.allocate(5000)
    assert (a.offset, a.reserved, b.offset, b.reserved) == (0, ALIGN, ALIGN, 2 * ALIGN)
    assert os.path.getsize(f.path) >= b.end  # preallocated
    f.release(a)
    assert f.allocate(100).offset == 0


def test_read_after_write_and_write_after_read_are_ordered(tmp_path, engine):
    space = SwapSpace(str(tmp_path), rank=0)
    store = SwapStore(engine, space)
    f = space.create_file("x.swp", engine)
    ext = f.allocate(8 << 20)
    for i in range(5):
        src = aligned_empty(ext.reserved)
        src.copy_(torch.randint(0, 256, (ext.reserved,), dtype=torch.uint8))
        store.write_span(f, ext.offset, src, "w")          # not waited for
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
