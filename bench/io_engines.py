#!/usr/bin/env python3
"""Thin entry: `python bench/io_engines.py ARGS` is `aidaptiv-ds io-bench ARGS` from this checkout."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aidaptiv_ds.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["io-bench", *sys.argv[1:]]))
