"""Thin entry script for `aidaptiv-ds io-bench` (same arguments): python bench/io_bench.py --help"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aidaptiv_ds.harness import io_bench  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="io_bench.py", description=io_bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    io_bench.add_arguments(parser)
    sys.exit(io_bench.run(parser.parse_args()))
