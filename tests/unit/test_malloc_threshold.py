"""The fixed mmap threshold (aidaptiv.malloc_mmap_threshold): freed layer-sized tensors leave the process."""
import subprocess
import sys

import pytest

from aidaptiv_ds.config import parse_mmap_threshold

# Free a 24 MiB tensor (glibc's dynamic threshold then rises to 24 MiB), then make twenty 8 MiB tensors and
# free every other one while the last stays: in the heap they cannot be trimmed away; mapped on their own
# they are unmapped at once. Prints the anonymous RSS still held over the start, in MiB.
PROBE = r"""
import sys, torch
from aidaptiv_ds.malloc_threshold import applied, set_mmap_threshold
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
    assert dynamic > 40          # about the ten freed 8 MiB tensors
    assert fixed < 10


def test_threshold_setting_is_a_size_up_to_glibcs_limit():
    assert parse_mmap_threshold("1MiB") == 1 << 20 and parse_mmap_threshold(0) == 0
    with pytest.raises(ValueError, match="above glibc's limit"):
        parse_mmap_threshold("64MiB")
    with pytest.raises(ValueError, match="not a size"):
        parse_mmap_threshold("big")
