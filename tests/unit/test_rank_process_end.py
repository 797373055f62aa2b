"""A rank of a multi-rank run ends through rank_env.end_rank_process: its exit hooks run and its output is
flushed before the process ends with the run's code, without the interpreter's teardown (where gloo's threads
once aborted a rank that had finished cleanly)."""

import subprocess
import sys

CHILD = r"""
import atexit, sys, threading
from aidaptiv_ds.job.rank_env import end_rank_process

atexit.register(lambda: open(sys.argv[1], "w").write("hook ran"))
sys.stdout.write("buffered, never flushed by hand")  # a pipe: block-buffered
# A thread still running, as gloo's are: the interpreter's teardown would wait for a non-daemon thread.
threading.Thread(target=threading.Event().wait, daemon=False).start()
end_rank_process(3)
print("not reached")
"""


def test_a_rank_ends_with_its_code_after_its_exit_hooks_and_with_its_output_flushed(tmp_path):
    marker = tmp_path / "hook"
    p = subprocess.run([sys.executable, "-c", CHILD, str(marker)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "buffered, never flushed by hand"
    assert marker.read_text() == "hook ran"
