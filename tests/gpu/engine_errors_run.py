"""`aidaptiv-ds train ARGS` with the engine's errors raised on purpose in the middle of training, where the
first H100 runs died (bench/results/gpu_probe/h100: SIGSEGV at the swapper's first C++ OutOfPinnedMemory).

When the host budget is first full (the point where the pool used to throw), before anything else, four
C++ exceptions are raised and caught, each announced first so that the last line printed names the layer
that breaks: torch's own (c10::Error), and three of the engine's (aidaptiv_ds.engine._C: InvalidArgument ->
ValueError, OutOfPinnedMemory -> MemoryError, SystemError -> FileNotFoundError). Training then goes on.

    python tests/gpu/engine_errors_run.py train --config ... (train's arguments)
"""

import os
import sys
import tempfile

import torch

from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.swap import host_memory

probed = []
take = host_memory.HostMemory._allocate


def probe():
    cases = [
        ("torch c10::Error", RuntimeError, lambda: torch.empty(-1)),
        ("engine InvalidArgument", ValueError, lambda: PinnedPool(4096).allocate(-5)),
        ("engine OutOfPinnedMemory", MemoryError, lambda: PinnedPool(4096).allocate(1 << 20)),
        (
            "engine SystemError",
            FileNotFoundError,
            lambda: IOEngine(backend="posix").read(
                PinnedPool(4096).allocate(4096), os.path.join(tempfile.gettempdir(), "no-such-dir", "x")
            ),
        ),
    ]
    for name, expected, raise_it in cases:
        print(f"PROBE {name}: raising", flush=True)
        try:
            raise_it()
        except expected as e:
            print(f"PROBE {name}: caught {type(e).__name__}", flush=True)


def _allocate(self, nbytes, large):
    buf = take(self, nbytes, large)
    if buf is None and not probed:  # the budget is full for the first time
        probed.append(True)
        probe()
    return buf


host_memory.HostMemory._allocate = _allocate

if __name__ == "__main__":
    from aidaptiv_ds.cli import main

    sys.exit(main(sys.argv[1:]))
