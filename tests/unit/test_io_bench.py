"""io-bench's pure-Python parts: arguments, filesystem checks, fio parsing, the JSON row. No extension needed."""

import argparse
import json

import pytest

from aidaptiv_ds.commands import io_bench as io_bench_command
from aidaptiv_ds.engine import disk
from aidaptiv_ds.harness import io_bench

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw 0 0
tmpfs /tmp tmpfs rw,nosuid 0 0
/dev/nvme0n1p1 /mnt/nvme xfs rw 0 0
overlay /mnt/nvme/overlay overlay rw 0 0
/dev/sdb1 /mnt/with\\040space ext4 rw 0 0
"""


def parse(argv):
    parser = argparse.ArgumentParser()
    io_bench_command.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults():
    args = parse([])
    assert (args.nvme_path, args.size_mb, args.block_kb, args.queue_depth, args.repeat, args.json) == (
        None,
        1024,
        1024,
        32,
        3,
        False,
    )
    assert args.engines is None  # all engines; fio only when on PATH
    assert io_bench.default_engines()[:3] == ["uring", "posix", "deepspeed"]


def test_engine_list_parsing():
    assert parse(["--engines", "io_uring, posix,ds,uring"]).engines == ["uring", "posix", "deepspeed"]
    assert io_bench_command.parse_engines("FIO") == ["fio"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown engine 'spdk'"):
        io_bench_command.parse_engines("uring,spdk")
    with pytest.raises(argparse.ArgumentTypeError):
        io_bench_command.parse_engines(" , ")
    with pytest.raises(SystemExit):
        parse(["--size-mb", "0"])
    with pytest.raises(SystemExit):
        parse(["--queue-depth", "x"])


def test_block_size_checks():
    io_bench_command.check_config(1024, 1024)
    with pytest.raises(ValueError, match="multiple of 4"):
        io_bench_command.check_config(1024, 6)
    with pytest.raises(ValueError, match="larger than --size-mb"):
        io_bench_command.check_config(1, 2048)


def test_mount_lookup():
    assert disk.mount_of("/work/x", MOUNTS)["fstype"] == "ext4"
    assert disk.mount_of("/tmp/a/b", MOUNTS)["fstype"] == "tmpfs"
    assert disk.mount_of("/tmpfoo", MOUNTS)["fstype"] == "ext4"  # a prefix of the name is not a parent
    assert disk.mount_of("/mnt/nvme/data", MOUNTS)["source"] == "/dev/nvme0n1p1"
    assert disk.mount_of("/mnt/nvme/overlay/x", MOUNTS)["fstype"] == "overlay"
    assert disk.mount_of("/mnt/with space/f", MOUNTS)["source"] == "/dev/sdb1"


def test_memory_filesystems_are_refused(tmp_path):
    mounts = f"tmpfs {tmp_path} tmpfs rw 0 0\n"
    with pytest.raises(disk.UnsuitableDisk, match="tmpfs .memory, not a disk."):
        disk.check_dir(str(tmp_path), mounts)


def test_fio_json_parsing():
    text = "note: both iodepth >= 1 and synchronous I/O engine\n" + json.dumps(
        {
            "jobs": [
                {
                    "jobname": "x",
                    "error": 0,
                    "job_runtime": 500,
                    "usr_cpu": 2.0,
                    "sys_cpu": 8.0,
                    "write": {"io_bytes": 1 << 30, "bw_bytes": 2147483648, "runtime": 500},
                    "read": {"io_bytes": 0, "bw_bytes": 0, "runtime": 0},
                }
            ]
        }
    )
    sample = io_bench.parse_fio(text, "write")
    assert sample.gbps == pytest.approx((1 << 30) / 0.5 / 1e9)
    assert sample.cpu_s_per_gb == pytest.approx(0.10 * 0.5 / ((1 << 30) / 1e9))
    with pytest.raises(RuntimeError, match="moved 0 bytes"):
        io_bench.parse_fio(text, "read")
    with pytest.raises(RuntimeError, match="no JSON"):
        io_bench.parse_fio("fio: something went wrong", "read")


def test_fio_command_matches_the_config():
    cmd = io_bench.fio_command("/d/f", "read", 1 << 30, 1 << 20, 32)
    assert {
        "--rw=read",
        "--bs=1048576",
        f"--size={1 << 30}",
        "--ioengine=io_uring",
        "--iodepth=32",
        "--direct=1",
    } <= set(cmd)


def test_summary_shape_and_medians():
    s = io_bench.Sample
    samples = {
        "write": [s(10**9, 1.0, 0.1), s(10**9, 0.5, 0.2), s(10**9, 0.25, 0.3)],
        "read": [s(10**9, 0.5, 0.05), s(10**9, 0.5, 0.05), s(10**9, 2.0, 0.05)],
    }
    entry = io_bench.summarize(samples, [True, True, True])
    assert entry["write_gbps"] == 2.0 and entry["read_gbps"] == 2.0
    assert entry["cpu_s_per_gb_write"] == 0.2 and entry["cpu_s_per_gb_read"] == 0.05
    assert entry["verified"] is True and entry["repeats"] == 3
    assert io_bench.summarize(samples, [True, False, True])["verified"] is False
    assert io_bench.summarize(samples, [None] * 3)["verified"] is None
    failed = io_bench.summarize({"read": [], "write": []}, [], "RuntimeError: no libaio")
    assert failed == {"error": "RuntimeError: no libaio"}
    result = {
        "machine": {
            "cpu": "x",
            "cores": 2,
            "ram_gib": 1.0,
            "kernel": "6",
            "dir": "/d",
            "filesystem": "ext4",
            "source": "/dev/vda",
            "device": "/dev/vda",
            "rotational": False,
        },
        "engines": {"uring": entry, "fio": entry, "deepspeed": failed},
        "config": {"size_mb": 1, "block_kb": 4, "queue_depth": 1, "repeat": 3},
    }
    assert json.loads(json.dumps(result)) == result  # one plain JSON object
    table = io_bench.format_table(result)
    assert table.splitlines()[0].startswith("machine: x (flags not recorded), 2 cores")
    assert "deepspeed  error: RuntimeError: no libaio" in table
    assert "uring / fio: read 1.00x, write 1.00x" in table
