#!/usr/bin/env python3
"""Thin entry: `python bench/sweep.py ...` is `aidaptiv-ds sweep ...` (see aidaptiv_ds/harness/sweep.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aidaptiv_ds.harness.sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
