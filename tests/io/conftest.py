"""Fixtures of the engine tier: a shared pinned pool, aligned buffers, engines of each backend, and a way to
run a snippet in a child process (for limits and privileges we must not change in the test process)."""
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import aidaptiv_ds
from aidaptiv_ds.io import ALIGNMENT, IOEngine, PinnedPool

BACKENDS = ["io_uring", "posix"]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(aidaptiv_ds.__file__)))


@pytest.fixture(scope="session")
def pool():
    return PinnedPool(256 << 20)


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def plain_aligned(n: int) -> torch.Tensor:
    """A 4 KiB-aligned uint8 tensor from torch's ordinary allocator (not from any pool)."""
    base = torch.empty(n + ALIGNMENT, dtype=torch.uint8)
    skip = (-base.data_ptr()) % ALIGNMENT
    return base[skip:skip + n]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def engine(backend, pool):
    with IOEngine(backend=backend, pool=pool) as e:
        yield e


@pytest.fixture
def shared_dir(tmp_path):
    """A directory other users can enter (tmp_path's parents are 0700), on tmp_path's filesystem."""
    top = os.path.join("/", str(tmp_path).split(os.sep)[1])
    path = tempfile.mkdtemp(prefix="aidaptiv-test-", dir=os.environ.get("AIDAPTIV_TEST_DIR", top))
    os.chmod(path, 0o755)
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


def run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run Python code in a child process that imports this checkout's aidaptiv_ds."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd="/")
