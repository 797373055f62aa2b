"""The fixed mmap threshold (aidaptiv.malloc_mmap_threshold): freed layer-sized tensors leave the process."""

import subprocess
import sys

import pytest

from aidaptiv_ds.config.schema import parse_mmap_threshold

# Free a 24 MiB tensor (glibc's dynamic threshold then rises to 24 MiB), then make twenty 8 MiB tensors and
# free every other one while the last stays: in the heap they cannot be trimmed away; mapped on their own
# they are unmapped at once. Prints the anonymous RSS still held over the start, in MiB.
PROBE = r"""
import sys, torch
from aidaptiv_ds.common.malloc_threshold import applied, set_mmap_threshold
if sys.argv[1] == "fixed":
    assert set_mmap_threshold(1 << 20) is None and applied() == 1 << 20
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
base = anon()
big = torch.ones((24 << 20) // 4)
del big
bufs = [torch.ones((8 << 20) // 4) for _ in range(20)]
for i in range(0, 19, 2):
    bufs[i] = None
print(anon() - base - 10 * 8)      # what is held beyond the ten live tensors
"""


def _held(mode):
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip().splitlines()[-1])


def test_freed_tensors_leave_the_heap_with_the_threshold_fixed():
    dynamic, fixed = _held("dynamic"), _held("fixed")
    print(f"held beyond the live tensors: glibc's dynamic threshold {dynamic:.0f} MiB, fixed {fixed:.0f} MiB")
    assert dynamic > 40  # about the ten freed 8 MiB tensors
    assert fixed < 10


def test_threshold_setting_is_a_size_up_to_glibcs_limit():
    assert parse_mmap_threshold("1MiB") == 1 << 20 and parse_mmap_threshold(0) == 0
    with pytest.raises(ValueError, match="above glibc's limit"):
        parse_mmap_threshold("64MiB")
    with pytest.raises(ValueError, match="not a size"):
        parse_mmap_threshold("big")


# Under the fixed 1 MiB threshold: two hundred 512 KiB tensors from the heap, every other one freed while the
# last stays, so the heap cannot shrink from its top. Prints the anonymous RSS held beyond the live tensors
# before and after trim_heap.
TRIM_PROBE = r"""
import torch
from aidaptiv_ds.common.malloc_threshold import set_mmap_threshold, trim_heap
set_mmap_threshold(1 << 20)
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
base = anon()
bufs = [torch.ones((512 << 10) // 4) for _ in range(200)]
for i in range(0, 199, 2):
    bufs[i] = None
live = 100 * 0.5
before = anon() - base - live
released = trim_heap()
print(before, anon() - base - live, released)
"""


def test_trim_heap_gives_the_heaps_holes_back():
    r = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    before, after, released = r.stdout.strip().splitlines()[-1].split()
    print(f"held beyond the live tensors: {float(before):.0f} MiB before trim_heap, {float(after):.0f} after")
    assert float(before) > 40  # about the hundred freed 512 KiB tensors
    assert float(after) < 10 and released == "True"


@pytest.mark.parametrize("value,ok", [(True, True), (False, True), ("auto", True), ("yes", False), (1, False)])
def test_trim_heap_setting(tmp_path, value, ok):
    from aidaptiv_ds.config.resolve import ConfigError, validate

    cfg = {
        "zero_optimization": {"stage": 3},
        "aidaptiv": {"enabled": True, "nvme_path": str(tmp_path), "trim_heap": value},
    }
    if ok:
        assert validate(cfg).trim_heap == value
    else:
        with pytest.raises(ConfigError, match="trim_heap"):
            validate(cfg)
