"""Fixtures of the engine tier: a shared pinned pool, engines of each backend, a directory other users can
enter. Helpers are in engine_helpers.py."""

import os
import subprocess
import tempfile

import pytest
from engine_helpers import BACKENDS

from aidaptiv_ds.engine.io import IOEngine, PinnedPool


@pytest.fixture(scope="session")
def pool():
    return PinnedPool(256 << 20)


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
