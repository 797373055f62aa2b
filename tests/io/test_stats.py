"""Statistics, pool accounting and settings precedence (defaults, then environment, then arguments)."""

import gc

import pytest
import torch
from engine_helpers import random_bytes

from aidaptiv_ds.engine.io import Backend, IOEngine, PinnedPool, resolve_settings


def test_engine_counters(engine, pool, tmp_path):
    buf = pool.allocate((1 << 20) + 10)
    buf.copy_(random_bytes(buf.numel()))
    for i in range(3):
        engine.write(buf, tmp_path / f"s{i}.bin")
    for i in range(2):
        engine.read(buf, tmp_path / f"s{i}.bin")
    with pytest.raises(OSError):
        engine.read(buf, tmp_path / "s0.bin", 1 << 20)  # past the end
    s = engine.stats()
    assert s["bytes_written"] == 3 * buf.numel() and s["writes"] == 3
    assert s["bytes_read"] == 2 * buf.numel() and s["reads"] == 2
    assert s["errors"] == 1 and s["in_flight"] == 0
    assert s["wait_seconds"] > 0
    assert s["backend"] == engine.backend.value
    assert s["pool"]["capacity"] == pool.capacity


def test_pool_views_and_accounting():
    pool = PinnedPool(10 * 4096 + 1)  # rounded up to whole pages
    assert pool.capacity == 11 * 4096
    a = pool.allocate(100, torch.float32)  # 400 bytes take one 4 KiB block
    b = pool.allocate(4097, torch.uint8)  # two blocks
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert pool.contains(a) and pool.contains(b) and not pool.contains(torch.empty(10))
    s = pool.stats()
    assert (s["in_use"], s["blocks"]) == (3 * 4096, 2)
    assert s["locked"] and s["lock_method"] in ("mlock", "cudaHostRegister")
    view = b[4096:]
    del b
    gc.collect()
    assert pool.stats()["in_use"] == 3 * 4096, "a view keeps its block"
    del view, a
    gc.collect()
    s = pool.stats()
    assert s["in_use"] == 0 and s["high_water"] == 3 * 4096
    whole = pool.allocate(11 * 4096)  # everything coalesced back into one block
    assert pool.contains(whole)


def test_pool_outlives_its_python_object():
    t = PinnedPool(1 << 20).allocate(1000, torch.int64)
    gc.collect()
    t.fill_(3)  # the tensor's deleter holds the pool
    assert int(t.sum()) == 3000


def test_settings_precedence(monkeypatch):
    for name in ("AIDAPTIV_BACKEND", "AIDAPTIV_BLOCK_SIZE", "AIDAPTIV_QUEUE_DEPTH"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_settings() == {"backend": Backend.AUTO, "block_size": 1 << 20, "queue_depth": 32}
    monkeypatch.setenv("AIDAPTIV_BACKEND", "posix")
    monkeypatch.setenv("AIDAPTIV_BLOCK_SIZE", "256K")
    monkeypatch.setenv("AIDAPTIV_QUEUE_DEPTH", "8")
    assert resolve_settings() == {"backend": Backend.POSIX, "block_size": 256 << 10, "queue_depth": 8}
    assert resolve_settings("uring", 8192, 4) == {"backend": Backend.IO_URING, "block_size": 8192, "queue_depth": 4}
    with IOEngine() as engine:
        assert engine.backend is Backend.POSIX
    monkeypatch.setenv("AIDAPTIV_BLOCK_SIZE", "lots")
    with pytest.raises(ValueError, match="AIDAPTIV_BLOCK_SIZE"):
        resolve_settings()


def test_block_size_variable_reads_sizes_like_the_config(monkeypatch):
    """One parser (aidaptiv_ds.common.sizes): 1M and 1MiB are 2^20, 1MB is 10^6, as the README documents."""
    for text, expected in (("1M", 1 << 20), ("1MiB", 1 << 20), ("1MB", 10**6), ("64k", 64 << 10)):
        monkeypatch.setenv("AIDAPTIV_BLOCK_SIZE", text)
        assert resolve_settings()["block_size"] == expected, text


def test_bad_settings_raise_value_error():
    with pytest.raises(ValueError, match="block_size 1000"):
        IOEngine(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth 0"):
        IOEngine(queue_depth=0)
    with pytest.raises(ValueError, match="not a backend"):
        IOEngine(backend="spdk")


def test_device_copy_needs_a_cuda_build(tmp_path):
    from aidaptiv_ds.engine import _C

    if _C.WITH_CUDA:
        pytest.skip("this build has CUDA: tests/gpu covers the device copies")
    with IOEngine() as engine, pytest.raises(RuntimeError, match="built with CUDA"):
        engine.read_to_device(torch.zeros(10), tmp_path / "x.bin")


def _huge_page_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings of this process that overlap [start, end) (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def test_pool_is_huge_page_aligned_and_backed():
    """The pool's base is 2 MiB aligned, and where the kernel offers transparent huge pages the pool is in them
    (physically contiguous 2 MiB: a 1 MiB I/O piece is one DMA segment, not up to 256)."""
    pool = PinnedPool(16 << 20)
    t = pool.allocate(16 << 20)
    base = t.data_ptr()
    assert base % (2 << 20) == 0
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    assert _huge_page_bytes(base, base + t.numel()) > 0
