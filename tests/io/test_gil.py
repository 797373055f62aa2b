"""A blocking read releases the GIL: another Python thread runs while it is in flight."""

import threading
import time

from engine_helpers import random_bytes

from aidaptiv_ds.engine.io import IOEngine


def test_blocking_read_releases_the_gil(backend, pool, tmp_path):
    n = 64 << 20
    buf = pool.allocate(n)
    buf.copy_(random_bytes(n))
    path = tmp_path / "gil.bin"
    # Queue depth 1 makes the read long (one 1 MiB piece at a time), so there is a middle to look at.
    with IOEngine(backend=backend, queue_depth=1, pool=pool) as engine:
        engine.write(buf, path)
        ticks = []
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks.append(time.perf_counter())

        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        engine.read(buf, path)
        t1 = time.perf_counter()
        stop.set()
        spinner.join()
    # If the read held the GIL, no Python code could run between its start and its end; look only at the
    # middle 60% so that the switches around the call do not count.
    lo, hi = t0 + 0.2 * (t1 - t0), t1 - 0.2 * (t1 - t0)
    during = sum(1 for t in ticks if lo <= t <= hi)
    assert t1 - t0 > 0.01, "the read was too quick to tell"
    assert during > 100, f"another thread ran only {during} times during a {t1 - t0:.3f} s read"
