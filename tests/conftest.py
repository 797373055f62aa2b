import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # import aidaptiv_ds from this checkout even when not installed
# Test modules import their shared helpers as `helpers` (tests/helpers.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import REPO  # noqa: E402


@pytest.fixture
def repo():
    return REPO
