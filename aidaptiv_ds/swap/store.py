"""Swap space: a few large preallocated files per rank, extents inside them, and the host memory that
stages or caches their contents. :class:`SwapSpace` and :class:`SwapFile` live in :mod:`aidaptiv_ds.swap.space`,
:class:`HostMemory` in :mod:`aidaptiv_ds.swap.host_memory`; this module puts them together.

- :class:`SwapSpace` owns one runtime's folder under the rank's directory and its files, and enforces the
  rules: the rank's directory locked for the life of the job (a second job on the same path fails, naming
  the holder; what a job that ended left is removed only once its lock is free), directories 0700, files
  0600 created with O_EXCL, no symlinks followed, no reuse of files another user owns, nothing written
  outside the configured path, files removed at close unless kept.
- :class:`SwapFile` is one such file with a bump allocator of 4 KiB-aligned extents; the file grows with
  ``posix_fallocate`` as extents are handed out, so running out of disk is reported at allocation time
  with the number of bytes that were needed.
- :class:`HostMemory` hands out 4 KiB-aligned host buffers from the engine's pinned pool, never more than
  the budget; when the pool is full it asks registered reclaimers (write-behind completions, retained
  layer groups) to give memory back before it gives up with an error that says what to change.
- :class:`SwapStore` puts them together and tracks read-after-write and write-after-read hazards between
  requests that overlap on disk, so a read never sees a half-written extent and a write-behind never races
  the read-ahead of the same bytes.

Nothing here knows about DeepSpeed or its layouts; :mod:`aidaptiv_ds.zero3` decides what goes where (and asks
for any folder DeepSpeed needs with :meth:`SwapSpace.make_subdir`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from aidaptiv_ds.common.sizes import (  # the swappers import these two from here too
    ALIGN,
)
from aidaptiv_ds.engine.file_size_limit import efbig_not_sigxfsz
from aidaptiv_ds.engine.io import IOEngine, IORequest
from aidaptiv_ds.swap.space import SwapFile, SwapSpace


@dataclass
class Ticket:
    """One or more engine requests that belong together (a span, or its pieces)."""

    requests: List[IORequest] = field(default_factory=list)
    what: str = ""

    def done(self) -> bool:
        return all(r.done() for r in self.requests)

    def wait(self) -> int:
        total = 0
        first_error = None
        for r in self.requests:
            try:
                total += r.wait()
            except OSError as e:  # drain the rest before raising: their buffers must not be reused early
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return total


class SwapStore:
    """Reads and writes of extents, with hazard tracking and statistics.

    A *span* is a contiguous byte range of one file, read into or written from one host buffer. Callers
    lay out related tensors contiguously (a layer group, an optimizer sub-group) so one span moves them
    all in a single large request.
    """

    def __init__(self, engine: IOEngine, space: SwapSpace):
        self.engine = engine
        self.space = space
        self._inflight: Dict[int, List[Tuple[int, int, bool, Ticket]]] = {}  # id(file) -> (start, end, is_write, t)
        self._lock = threading.Lock()
        self.io_wait_s = 0.0

    def _conflicts(self, file: SwapFile, start: int, end: int, is_write: bool) -> List[Ticket]:
        entries = self._inflight.get(id(file), [])
        live = [e for e in entries if not e[3].done()]
        self._inflight[id(file)] = live
        # A read must wait for overlapping writes; a write for overlapping reads and writes.
        return [t for (s, e, w, t) in live if s < end and start < e and (w or is_write)]

    def _submit(self, file: SwapFile, offset: int, buf: torch.Tensor, is_write: bool, what: str) -> Ticket:
        if offset % ALIGN:
            raise ValueError(f"span offset {offset} in {file.path} is not 4096-aligned")
        if buf.device.type != "cpu":
            # The engine refuses it too, but without saying whose buffer it was (no traceback is kept).
            raise ValueError(
                f"{'write' if is_write else 'read'} of {what or 'a span'} in {file.path}: the buffer is on "
                f"{buf.device}, but spans move host buffers only (stage device tensors through the "
                "host budget)"
            )
        end = offset + buf.numel()
        with self._lock:
            blockers = self._conflicts(file, offset, end, is_write)
        for t in blockers:
            self.wait(t)
        # One fstat per span: a file truncated under the job must not be read as zeros.
        file.check_size(offset, buf.numel(), is_write)
        submit = self.engine.write_async if is_write else self.engine.read_async
        with efbig_not_sigxfsz():  # io_uring may issue the write in this thread
            ticket = Ticket([submit(buf, file.handle, offset)], what)
        with self._lock:
            self._inflight.setdefault(id(file), []).append((offset, end, is_write, ticket))
        return ticket

    def read_span(self, file: SwapFile, offset: int, buf: torch.Tensor, what: str = "") -> Ticket:
        """Start reading ``buf.numel()`` bytes (``buf`` is uint8, aligned) at ``offset``."""
        return self._submit(file, offset, buf, False, what)

    def write_span(self, file: SwapFile, offset: int, buf: torch.Tensor, what: str = "") -> Ticket:
        """Start writing ``buf`` at ``offset``. The caller keeps ``buf`` alive until the ticket completes."""
        return self._submit(file, offset, buf, True, what)

    def wait(self, ticket: Ticket) -> int:
        """Wait for one ticket; the time spent is counted as I/O wait."""
        if ticket.done():
            return ticket.wait()
        t0 = time.perf_counter()
        try:
            return ticket.wait()
        finally:
            self.io_wait_s += time.perf_counter() - t0

    def drain(self) -> None:
        """Wait for every request this store started."""
        with self._lock:
            tickets = [t for entries in self._inflight.values() for (_, _, _, t) in entries]
            self._inflight.clear()
        for t in tickets:
            self.wait(t)
