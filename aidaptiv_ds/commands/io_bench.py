"""Measure O_DIRECT write and read bandwidth, and CPU time per GB, of the I/O engines on one disk, in one run.

  aidaptiv-ds io-bench --nvme-path /mnt/nvme --size-mb 1024 --repeat 3
  aidaptiv-ds io-bench --engines uring,deepspeed --json >> rows.jsonl

Each repeat runs every engine in turn (the order reversed every other repeat), writing --size-mb MiB to a fresh
file and reading it back with O_DIRECT, checking the bytes; see aidaptiv_ds.harness.io_bench for the engines and
what is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import List

from aidaptiv_ds.commands import flags
from aidaptiv_ds.engine.disk import UnsuitableDisk, check_dir, swap_folder_problem
from aidaptiv_ds.harness.io_bench import (
    ALIASES,
    ENGINES,
    default_engines,
    fio_command,
    format_table,
    git_sha,
    machine_info,
    measure,
    stdout_to_stderr,
)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def parse_engines(text: str) -> List[str]:
    """'uring, posix,ds' -> ['uring', 'posix', 'deepspeed'] (order kept, duplicates dropped)."""
    engines: List[str] = []
    for part in text.split(","):
        name = ALIASES.get(part.strip().lower(), part.strip().lower())
        if not name:
            continue
        if name not in ENGINES:
            raise argparse.ArgumentTypeError(f"unknown engine {part.strip()!r}: choose from {', '.join(ENGINES)}")
        if name not in engines:
            engines.append(name)
    if not engines:
        raise argparse.ArgumentTypeError(f"no engine named: choose from {', '.join(ENGINES)}")
    return engines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add(
        parser,
        flags.NVME_PATH,
        aliases=("--dir",),
        default=None,
        help="directory on the disk to measure (default: a temporary directory under the "
        "current directory, removed afterwards); tmpfs and filesystems without O_DIRECT "
        "are refused",
    )
    parser.add_argument("--size-mb", type=positive_int, default=1024, help="MiB written and read per engine (1024)")
    parser.add_argument("--block-kb", type=positive_int, default=1024, help="KiB per I/O, a multiple of 4 (1024)")
    parser.add_argument("--queue-depth", type=positive_int, default=32, help="I/Os in flight (32)")
    parser.add_argument(
        "--engines",
        type=parse_engines,
        default=None,
        help=f"comma-separated, from {','.join(ENGINES)} (default: all; fio when on PATH)",
    )
    parser.add_argument("--repeat", type=positive_int, default=3, help="repetitions, interleaved (3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def check_config(size_mb: int, block_kb: int) -> None:
    if block_kb % 4:
        raise ValueError(f"--block-kb {block_kb} is not a multiple of 4: O_DIRECT moves whole 4 KiB blocks")
    if block_kb > size_mb * 1024:
        raise ValueError(f"--block-kb {block_kb} is larger than --size-mb {size_mb}: use a smaller block")


def run(args) -> int:
    engines = args.engines or default_engines()
    size, block = args.size_mb << 20, args.block_kb << 10
    created = None
    try:
        check_config(args.size_mb, args.block_kb)
        directory = args.nvme_path
        if directory is None:
            created = directory = tempfile.mkdtemp(prefix=".io-bench-", dir=os.getcwd())
        else:  # the rule of every swap folder: it exists, on a disk that takes O_DIRECT, writable
            problem = swap_folder_problem(directory)
            if problem:
                raise ValueError(f"--nvme-path {problem}")
        try:
            mount = check_dir(directory)
        except UnsuitableDisk as e:
            raise ValueError(f"--nvme-path {e}") from None
        free = shutil.disk_usage(directory).free
        if free < size * 1.1:
            raise ValueError(
                f"--nvme-path {directory} has {free >> 20} MiB free, the run needs about {size >> 20} MiB: "
                "free space or lower --size-mb"
            )
        machine = machine_info(directory, mount)
        config = {
            "size_mb": args.size_mb,
            "block_kb": args.block_kb,
            "queue_depth": args.queue_depth,
            "repeat": args.repeat,
            "engines": engines,
            "direct": True,
            "git_sha": git_sha(),
            "fio_command": " ".join(fio_command("FILE", "write|read", size, block, args.queue_depth)),
        }
        if not args.json:
            print(format_table({"machine": machine, "config": config, "engines": {}}).splitlines()[0], flush=True)
        with stdout_to_stderr():
            results = measure(engines, directory, size, block, args.queue_depth, args.repeat)
    except ValueError as e:
        print(f"io-bench: error: {e}", file=sys.stderr)
        return 2
    finally:
        if created:
            shutil.rmtree(created, ignore_errors=True)
    result = {"machine": machine, "engines": results, "config": config}
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(format_table(result).splitlines()[1:]))
    bad = [name for name, e in results.items() if e.get("verified") is False]
    return 1 if bad else 0
