import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # import aidaptiv_ds from this checkout even when not installed
# Test modules import their shared helpers as `helpers` (tests/helpers.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import REPO  # noqa: E402


def pytest_sessionstart(session):
    """Free the RAM that DeepSpeed runs of earlier sessions left in /dev/shm (aidaptiv_ds.dist_shm): on a
    machine that has run this suite many times it is gigabytes the multi-rank tests then lack."""
    from aidaptiv_ds import dist_shm
    removed, freed = dist_shm.remove_stale_segments()
    if removed:
        print(f"\naidaptiv-ds tests: {dist_shm.describe_removed(removed, freed)}")


@pytest.fixture
def repo():
    return REPO
