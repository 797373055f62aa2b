"""Many swaps at once from several Python threads, byte for byte; the engine waits for I/O in flight
before it goes away."""

import threading

import torch
from engine_helpers import random_bytes

from aidaptiv_ds.engine import _C
from aidaptiv_ds.engine.io import IOEngine


def test_concurrent_swaps_from_threads(engine, pool, tmp_path):
    threads, swaps_per_thread = 8, 16  # 128 swaps, each a write and a read, all in flight together
    errors = []
    start = threading.Barrier(threads)

    def worker(t):
        try:
            start.wait()
            items = []
            for i in range(swaps_per_thread):
                n = 4096 * (1 + (t * 7 + i * 3) % 40) + (i * 511) % 4096  # odd sizes up to ~160 KiB
                data = random_bytes(n, seed=t * 1000 + i)
                buf = pool.allocate(n)
                buf.copy_(data)
                path = tmp_path / f"t{t}_{i}.bin"
                items.append((path, data, engine.write_async(buf, path, 4096 * i)))
            for path, data, request in items:
                assert request.wait() == data.numel()
            reads = []
            for i, (path, data, _) in enumerate(items):
                buf = pool.allocate(data.numel())
                reads.append((buf, data, engine.read_async(buf, path, 4096 * i)))
            for buf, data, request in reads:
                request.wait()
                assert torch.equal(buf, data), f"thread {t}: bytes differ"
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a worker hung"
    assert not errors, errors[0]
    stats = engine.stats()
    assert stats["writes"] == stats["reads"] == threads * swaps_per_thread
    assert stats["in_flight"] == 0


def test_destroying_the_engine_waits_for_io_in_flight(backend, pool, tmp_path):
    data = random_bytes(32 << 20, seed=3)
    buf = pool.allocate(data.numel())
    buf.copy_(data)
    options = _C.EngineOptions()
    options.backend = _C.BackendKind.IO_URING if backend == "io_uring" else _C.BackendKind.POSIX
    options.queue_depth = 4
    raw = _C.Engine(options, None)
    for i in range(4):
        raw.write_async(buf, str(tmp_path / f"d{i}.bin"), 0)
    del raw  # no wait: the destructor must let all four writes finish before it frees anything
    with IOEngine(backend=backend) as engine:
        for i in range(4):
            back = pool.allocate(data.numel())
            engine.read(back, tmp_path / f"d{i}.bin")
            assert torch.equal(back, data)
            del back


def test_wait_all_and_poll(engine, pool, tmp_path):
    buf = pool.allocate(8 << 20)
    buf.copy_(random_bytes(8 << 20, seed=5))
    requests = [engine.write_async(buf, tmp_path / f"w{i}.bin") for i in range(6)]
    engine.wait_all()
    assert all(r.done() for r in requests)
    assert [r.wait() for r in requests] == [8 << 20] * 6  # results stay readable after wait_all
    assert engine.stats()["in_flight"] == 0


def test_closing_a_file_with_io_in_flight(engine, pool, tmp_path):
    data = random_bytes(16 << 20, seed=9)
    buf = pool.allocate(data.numel())
    buf.copy_(data)
    f = engine.open(tmp_path / "c.bin", create=True)
    requests = [engine.write_async(buf[i << 22 : (i + 1) << 22], f, i << 22) for i in range(4)]
    engine.close(f)  # the requests keep the descriptors until they complete
    assert [r.wait() for r in requests] == [4 << 20] * 4
    back = pool.allocate(data.numel())
    engine.read(back, tmp_path / "c.bin")
    assert torch.equal(back, data)
