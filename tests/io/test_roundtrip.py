"""Round trips through both backends: odd sizes, registered and plain buffers, queue depth 1 and 32,
non-zero offsets, many files, byte for byte."""

import os

import pytest
import torch
from engine_helpers import plain_aligned, random_bytes

from aidaptiv_ds.engine.io import IOEngine

SIZES = [1, 4095, 4096, 4097, (1 << 20) + 124, 64 << 20]


@pytest.mark.parametrize("queue_depth", [1, 32])
@pytest.mark.parametrize("registered", [True, False], ids=["pool", "plain"])
def test_round_trip_sizes(backend, registered, queue_depth, pool, tmp_path):
    buffers = (lambda n: pool.allocate(n)) if registered else plain_aligned
    with IOEngine(backend=backend, queue_depth=queue_depth, pool=pool if registered else None) as engine:
        assert engine.backend.value == backend
        if backend == "io_uring" and registered:
            assert engine.fixed_buffers, "the pool should be registered as io_uring fixed buffers"
        for i, n in enumerate(SIZES):
            offset = 4096 * (3 + 5 * i)  # non-zero, aligned, different per file
            path = tmp_path / f"swap{i}.bin"
            data = random_bytes(n, seed=i)
            out = buffers(n)
            out.copy_(data)
            assert engine.write(out, str(path), offset) == n
            # The file is exactly offset + n long: the tail went through the buffered descriptor.
            assert os.path.getsize(path) == offset + n
            back = buffers(n)
            back.fill_(0xA5)
            assert engine.read(back, str(path), offset) == n
            assert torch.equal(back, data), f"size {n}: bytes read differ from bytes written"
            # And the file says the same when read without the engine.
            with open(path, "rb") as f:
                f.seek(offset)
                assert f.read(n) == data.numpy().tobytes()
            del out, back


def test_odd_write_keeps_neighbouring_bytes(engine, pool, tmp_path):
    path = str(tmp_path / "neighbours.bin")
    background = random_bytes(5 * 4096 + 100, seed=7)
    with open(path, "wb") as f:
        f.write(background.numpy().tobytes())
    patch = pool.allocate(4097)
    patch.copy_(random_bytes(4097, seed=8))
    f = engine.open(path)
    engine.write(patch, f, 4096)  # covers [4096, 8193): the tail block is shared with old bytes
    expected = background.clone()
    expected[4096:8193] = patch
    with open(path, "rb") as fh:
        assert fh.read() == expected.numpy().tobytes()
    assert os.path.getsize(path) == len(background)
    # A read through the O_DIRECT descriptor sees the buffered tail (the kernel flushes it first).
    back = pool.allocate(3 * 4096)
    engine.read(back, f, 4096)
    assert torch.equal(back, expected[4096 : 4096 + 3 * 4096])


def test_many_files_interleaved(engine, pool, tmp_path):
    files = [engine.open(tmp_path / f"f{i}.bin", create=True, exclusive=True) for i in range(24)]
    data = [random_bytes(4096 * (i + 1) + i * 37, seed=100 + i) for i in range(24)]
    writes = []
    for f, d in zip(files, data):
        buf = pool.allocate(d.numel())
        buf.copy_(d)
        writes.append(engine.write_async(buf, f, 8192))
    assert [w.wait() for w in writes] == [d.numel() for d in data]
    reads = []
    for f, d in zip(files, data):
        buf = pool.allocate(d.numel())
        reads.append((buf, engine.read_async(buf, f, 8192), d))
    for buf, request, d in reversed(reads):  # completion is per request: wait in any order
        assert request.wait() == d.numel()
        assert torch.equal(buf, d)
    for f in files:
        engine.close(f)
        assert f.closed
    mode = os.stat(tmp_path / "f0.bin").st_mode & 0o777
    assert mode == 0o600, f"swap files must be created 0600, got {oct(mode)}"
