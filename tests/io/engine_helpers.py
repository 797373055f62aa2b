"""Helpers of the engine tier (imported by name; fixtures live in conftest.py, which is never imported
by name since several conftest.py files share that module name)."""

import os
import subprocess
import sys
import textwrap

import torch

import aidaptiv_ds
from aidaptiv_ds.common.sizes import ALIGN

BACKENDS = ["io_uring", "posix"]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(aidaptiv_ds.__file__)))


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def plain_aligned(n: int) -> torch.Tensor:
    """A 4 KiB-aligned uint8 tensor from torch's ordinary allocator (not from any pool)."""
    base = torch.empty(n + ALIGN, dtype=torch.uint8)
    skip = (-base.data_ptr()) % ALIGN
    return base[skip : skip + n]


def run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run Python code in a child process that imports this checkout's aidaptiv_ds."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env, cwd="/"
    )
