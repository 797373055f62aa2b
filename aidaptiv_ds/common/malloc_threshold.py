"""Fix glibc's mmap threshold, so that freed large host buffers go back to the system, and trim the heap.

glibc serves an allocation above M_MMAP_THRESHOLD (128 KiB at start) with its own mmap and unmaps it on free.
But the threshold is dynamic: each time such a chunk is freed, the threshold rises to its size (up to 32 MiB
on 64-bit). After the first freed layer-sized tensor (tens of MiB: a gathered weight, a gradient, a block's
activation), every later allocation below that size comes from the heap, whose freed space glibc keeps. A
swapped training step allocates and frees such tensors all the time, so the process's RSS grows well past
what is live: about 200-300 MiB on the 58M-parameter ``tiny`` preset (docs/DESIGN.md, "Host memory").

Setting the threshold with mallopt(M_MMAP_THRESHOLD) fixes it and turns the dynamic rise off (the same as
the MALLOC_MMAP_THRESHOLD_ environment variable, but from inside the process, so that every way of
starting a job gets it). The cost is a fresh mapping, zero-filled by the kernel, for each large allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Optional

M_MMAP_THRESHOLD = -3  # malloc.h
# glibc caps the threshold at HEAP_MAX/2 (32 MiB on 64-bit); mallopt refuses a larger value.
MAX_THRESHOLD = 32 << 20

_lock = threading.Lock()
_applied: Optional[int] = None


def set_mmap_threshold(nbytes: int) -> Optional[str]:
    """Fix the threshold at ``nbytes`` (once per process; later calls with another value are ignored, as the
    first swapper's setting holds for the process). Returns why it could not be set, or None. 0 leaves glibc's
    dynamic threshold alone."""
    global _applied
    if nbytes <= 0:
        return None
    if nbytes > MAX_THRESHOLD:
        return f"malloc_mmap_threshold {nbytes} is above glibc's limit of {MAX_THRESHOLD} bytes"
    with _lock:
        if _applied is not None:
            return None
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            mallopt = getattr(libc, "mallopt", None)
        except OSError:
            mallopt = None
        if mallopt is None:
            return "this C library has no mallopt (not glibc): freed host buffers stay with the allocator"
        if mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) != 1:
            return f"mallopt(M_MMAP_THRESHOLD, {nbytes}) was refused: freed host buffers stay with the allocator"
        _applied = nbytes
        return None


def applied() -> Optional[int]:
    """The threshold this process fixed, or None."""
    return _applied


_malloc_trim = None


def trim_heap() -> bool:
    """Give the pages of the heap's free chunks back to the system (glibc's ``malloc_trim(0)``, which since
    glibc 2.8 releases whole free pages anywhere in the heap, not only at its top). Below the threshold,
    tensors freed in an order that leaves holes keep their pages resident: on the ``small`` preset on the CPU
    the heap held 339 MiB free at the peak. Returns whether anything was released; False without glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        name = ctypes.util.find_library("c")
        try:
            _malloc_trim = getattr(ctypes.CDLL(name), "malloc_trim", False) if name else False
        except OSError:
            _malloc_trim = False
    return bool(_malloc_trim and _malloc_trim(ctypes.c_size_t(0)))
