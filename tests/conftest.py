import os
import sys

import pytest

# Test modules import their shared helpers as `helpers` (tests/helpers.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import REPO  # noqa: E402


@pytest.fixture
def repo():
    return REPO
