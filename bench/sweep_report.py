#!/usr/bin/env python3
"""Thin entry: `python bench/sweep_report.py ARGS` is `aidaptiv-ds report ARGS` from this checkout."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aidaptiv_ds.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["report", *sys.argv[1:]]))
