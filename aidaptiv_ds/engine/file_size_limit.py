"""Writes past the file-size limit (``ulimit -f``, RLIMIT_FSIZE): an EFBIG error for the library's own writes,
without touching the signal disposition of the user's program.

A write that starts at or past the limit makes the kernel send SIGXFSZ to the thread that issued it, and
SIGXFSZ kills the process by default. The library used to ignore SIGXFSZ for the whole process, which
changes what the user's own writes do for as long as the process lives. (CPython itself ignores SIGXFSZ at
start-up; what matters is a program that sets it back to the default, or embeds Python without that, and
wants its own writes past the limit to end it.) Instead:

- the thread that issues one of our writes blocks SIGXFSZ around it (:func:`efbig_not_sigxfsz`); the write
  fails with EFBIG (the engine reports it with the file, offset and what to do), and the signal, left pending
  on that thread alone, is taken off before the thread's mask is restored, so it is never delivered;
- the engine's own threads (POSIX workers, the io_uring reaper, which resubmits short writes) are created
  inside that block and inherit the blocked mask, so a SIGXFSZ directed at one of them stays pending there
  and is never delivered; the kernel's io_uring workers block every signal already;
- swap files never grow past the limit (:func:`check_growth`), so swap I/O never reaches it at all.

Every other thread, and every write of the user's program, keeps the default: death by SIGXFSZ.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import signal
from typing import Iterator, Optional

_SIG = getattr(signal, "SIGXFSZ", None)


def limit() -> Optional[int]:
    """The soft file-size limit in bytes, or None when there is none."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def check_growth(path: str, new_size: int) -> None:
    """Raise EFBIG naming ``path`` when a file may not grow to ``new_size`` bytes under the file-size limit
    (checked before the growth, so the kernel never sends SIGXFSZ)."""
    lim = limit()
    if lim is not None and new_size > lim:
        raise OSError(
            errno.EFBIG,
            f"swap file {path} needs to grow to {new_size} bytes but the file-size limit "
            f"(ulimit -f) is {lim} bytes: raise it (ulimit -f unlimited) for the job, or "
            "lower what is swapped",
            path,
        )


@contextlib.contextmanager
def efbig_not_sigxfsz() -> Iterator[None]:
    """Within this block, in the calling thread only, a write past the file-size limit fails with EFBIG
    instead of killing the process; threads started in the block inherit that for their whole life."""
    if _SIG is None or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {_SIG})
    try:
        yield
    finally:
        if _SIG not in old:
            # The kernel directs SIGXFSZ at the writing thread: take the pending one off this thread, or
            # restoring the mask would deliver it (and kill the process) after all.
            while _SIG in signal.sigpending():
                if signal.sigtimedwait([_SIG], 0) is None:
                    break
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
