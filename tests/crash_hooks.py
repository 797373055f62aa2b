"""Crash hooks for tests, installed into aidaptiv_ds.common.durable from environment variables set by a test
for one child process (the package reads none of them):

- ``AIDAPTIV_DS_TEST_CRASH_AT=<k>``: the process kills itself with SIGKILL at the k-th crash point (counted
  from 1 since :func:`install_from_env`): a ``kill -9`` at a chosen moment of a save.
- ``AIDAPTIV_DS_TEST_SNAPSHOT_FROM=<dir>`` and ``AIDAPTIV_DS_TEST_SNAPSHOT_TO=<dir>``: at every crash point the
  first folder is copied to ``<to>/<k>`` (and its label written to ``<to>/<k>.label``): what a ``kill -9`` at
  that point would leave on disk, for every point of one run. Nothing else writes into the folder while a
  save runs, and every write before a point has completed, so the copy is that state exactly.

A child script calls :func:`install_from_env` after ``sys.path.insert(0, <tests folder>)``.
"""

from __future__ import annotations

import os
import shutil
import signal

from aidaptiv_ds.common import durable

_points = 0


def points_passed() -> int:
    """Crash points this process has passed since the hook was installed."""
    return _points


def _hook(label: str) -> None:
    global _points
    _points += 1
    snap_from = os.environ.get("AIDAPTIV_DS_TEST_SNAPSHOT_FROM")
    if snap_from:
        dst = os.path.join(os.environ["AIDAPTIV_DS_TEST_SNAPSHOT_TO"], str(_points))
        if os.path.isdir(snap_from):
            shutil.copytree(snap_from, dst, symlinks=True)
        else:
            os.makedirs(dst)
        with open(dst + ".label", "w", encoding="utf-8") as f:
            f.write(label)
    kill_at = os.environ.get("AIDAPTIV_DS_TEST_CRASH_AT")
    if kill_at and int(kill_at) == _points:
        os.kill(os.getpid(), signal.SIGKILL)


def install_from_env() -> bool:
    """Install the hook when either variable is set; whether it was."""
    if os.environ.get("AIDAPTIV_DS_TEST_CRASH_AT") or os.environ.get("AIDAPTIV_DS_TEST_SNAPSHOT_FROM"):
        durable.set_crash_hook(_hook)
        return True
    return False
