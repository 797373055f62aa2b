"""io-bench end to end, small: one JSON object on stdout, bytes verified, tmpfs refused."""

import json
import os
import subprocess
import sys

import pytest
from engine_helpers import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "bench", "io_engines.py")


def io_bench(*argv):
    return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=300)


def test_json_row(tmp_path):
    # deepspeed too: its logger writes to stdout, which must still hold nothing but the one object.
    result = io_bench(
        "--nvme-path",
        str(tmp_path),
        "--size-mb",
        "8",
        "--block-kb",
        "256",
        "--queue-depth",
        "4",
        "--repeat",
        "2",
        "--engines",
        "uring,posix,deepspeed",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)  # exactly one object, nothing else on stdout
    assert set(row) == {"machine", "engines", "config"}
    assert row["config"]["size_mb"] == 8 and row["config"]["engines"] == ["uring", "posix", "deepspeed"]
    assert row["engines"]["deepspeed"].get("verified") is True or "error" in row["engines"]["deepspeed"]
    assert row["machine"]["filesystem"] and row["machine"]["cores"] >= 1
    for name in ("uring", "posix"):
        e = row["engines"][name]
        assert e["verified"] is True and e["repeats"] == 2
        assert e["read_gbps"] > 0 and e["write_gbps"] > 0 and e["cpu_s_per_gb_read"] >= 0
    assert "[2/2] posix" in result.stderr  # progress goes to stderr
    assert os.listdir(tmp_path) == []  # every file removed


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_tmpfs_is_refused():
    result = io_bench("--nvme-path", "/dev/shm", "--size-mb", "8", "--engines", "uring")
    assert result.returncode == 2
    assert "memory, not a disk" in result.stderr and result.stdout == ""
