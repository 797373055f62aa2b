"""Processes the studio starts for one request (`generate` for the question writer, Compare and Chat; `plan`,
`export`, `report`) end with the studio, however it ends: stopped, crashed or killed with SIGKILL, which no
handler or `finally` sees. A generate writing question/answer records for a page that is gone only holds
memory and the swap disk.

Training runs are not started here: they are meant to outlive the studio (runs.py starts a supervisor in a
session of its own, which the studio finds again from the run's folder).

On Linux each child asks the kernel, between fork and exec, for SIGKILL when its parent dies
(prctl PR_SET_PDEATHSIG). The kernel's "parent" is the thread that forked, not the process: Gradio runs
handlers in worker threads that exit when idle (and a streaming handler resumes in any of them), so every child
is forked by one thread that lives as long as the studio. Elsewhere children are plain processes, ended by the
handlers' own `finally` only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

PR_SET_PDEATHSIG = 1  # linux/prctl.h

_forker: ThreadPoolExecutor | None = None
_forker_lock = threading.Lock()


def _prctl():
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _prctl() if sys.platform.startswith("linux") else None


def _die_with(parent_pid: int):
    """The preexec_fn of a child of ``parent_pid``: SIGKILL when it dies. Runs in the forked child, so it calls
    only what was looked up before the fork (no import, no lock another thread might hold)."""

    kill = int(signal.SIGKILL)

    def preexec():
        if _PRCTL(PR_SET_PDEATHSIG, kill, 0, 0, 0) != 0:
            raise OSError("prctl(PR_SET_PDEATHSIG) failed")  # Popen raises it in the studio
        if os.getppid() != parent_pid:  # the studio died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _forking_thread() -> ThreadPoolExecutor:
    # One worker, never idle-stopped (ThreadPoolExecutor keeps its threads until shutdown at interpreter exit).
    global _forker
    with _forker_lock:
        if _forker is None:
            _forker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="studio-children")
        return _forker


def popen(argv: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv, **kwargs) for a child that ends when the studio does."""
    if _PRCTL is None:
        return subprocess.Popen(argv, **kwargs)
    preexec = _die_with(os.getpid())
    return _forking_thread().submit(lambda: subprocess.Popen(argv, preexec_fn=preexec, **kwargs)).result()


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True, timeout=timeout) for a child that ends when the
    studio does (killed, and TimeoutExpired raised, past ``timeout``)."""
    with popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
