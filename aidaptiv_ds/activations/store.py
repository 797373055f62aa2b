"""Activations saved for the backward, held on NVMe in this rank's swap space instead of in memory.

:class:`ActivationStore` is a pair of ``torch.autograd.graph.saved_tensors_hooks``: while they are active
(``with store.hooks():`` around a forward), every tensor autograd saves that is worth it (not a parameter or
a view of one, not a leaf that requires grad, at least ``min_bytes``) is copied into a staging buffer of the
host budget and written to the store's own swap file, and autograd keeps only a small handle. In the backward
each handle is read back when autograd unpacks it; the handles packed just before it (the ones the backward
needs next, since it runs in reverse) are read ahead into staging buffers meanwhile, so the backward waits
for a read only when the disk is slower than the compute between two unpacks.

With gradient checkpointing (``torch.utils.checkpoint`` without re-entry, as Hugging Face's
``gradient_checkpointing_enable(use_reentrant=False)`` uses) the tensors the hooks see are what the
checkpoints keep: each block's input (saved when the checkpoint is entered, before its own hooks take over
inside the block) plus the few tensors saved outside the blocks. Inside a block checkpointing's own hooks win
(the innermost hooks apply), so recomputed intermediates never come here.

Memory: a write's staging buffer is given back when the write completes (seen at the next pack or unpack, or
waited for when the host budget needs it: the store registers reclaimers); writes in flight hold at most
``max_staging_bytes``; a read's staging buffer is given back as soon as its
contents are copied into the tensor autograd gets, and a read ahead is given back unused when the host budget
needs the room (it is read again when the backward gets there). Nothing else stays in RAM. Disk: the file grows in
regions as a step needs them and the regions are reused from the start once every handle of a step is gone
(activations are freed by the end of each backward), so the file holds about one step's activations.

I/O errors end the forward (a failed write surfaces at a later pack) or the backward (at the read of that
tensor) with an ``OSError`` that names the file and says what to do. Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from aidaptiv_ds.common.sizes import KiB, MiB, align_up
from aidaptiv_ds.swap.host_memory import HostMemory
from aidaptiv_ds.swap.space import SwapFile
from aidaptiv_ds.swap.store import SwapStore, Ticket

# The swap file grows by regions of at least this size; a step's activations fill regions in order.
REGION_BYTES = 64 * MiB
# A stored tensor moves through staging in pieces of at most this size: a long sequence's block input (48 MiB
# for tiny at 16,384 tokens) would otherwise need one free block of its whole size in a pool that the layer
# groups, gradients and optimizer state cut up, and fail with most of the budget free.
PIECE_BYTES = 8 * MiB


def _pieces(nbytes: int):
    """(start, end) byte ranges of a tensor's pieces."""
    return [(a, min(nbytes, a + PIECE_BYTES)) for a in range(0, nbytes, PIECE_BYTES)]


def _wait_quietly(tickets) -> None:
    """Wait for I/O whose result no longer matters (the kernel may still be using its buffers)."""
    for t in tickets:
        try:
            t.wait()
        except OSError:
            pass


@dataclass
class _Slot:
    """Where one stored tensor lives and what of it is in flight."""

    index: int  # pack order within the current cycle
    offset: int
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    read: Optional[List[Ticket]] = None  # a read (ahead or on demand), one ticket per piece
    buffer: Optional[List[torch.Tensor]] = None  # the pieces' staging
    handle: Optional[weakref.ref] = None


class StoredActivation:
    """What autograd keeps in place of a stored tensor."""

    __slots__ = ("slot", "__weakref__")

    def __init__(self, slot: _Slot):
        self.slot = slot


@dataclass
class ActivationStats:
    tensors_stored: int = 0
    bytes_stored: int = 0
    bytes_read: int = 0
    tensors_kept: int = 0  # saved tensors left in memory (parameters, small ones)
    read_wait_s: float = 0.0  # time the backward waited for reads (activation I/O wait)
    write_wait_s: float = 0.0  # time spent waiting for writes to give their staging back
    reads_ahead: int = 0  # reads started before the backward asked for them
    reads_dropped: int = 0  # reads ahead given back to the host budget before use (read again later)
    cycles: int = 0  # forward/backward cycles completed (every handle released)
    read_wait_s_cycles: List[float] = field(default_factory=list)


class ActivationStore:
    """Saved tensors of forwards run under :meth:`hooks`, stored in ``file`` (this store's own)."""

    def __init__(
        self,
        store: SwapStore,
        file: SwapFile,
        memory: HostMemory,
        read_ahead: int = 2,
        min_bytes: int = 64 * KiB,
        max_staging_bytes: Optional[int] = None,
    ):
        if read_ahead < 0 or min_bytes < 0:
            raise ValueError(f"read_ahead {read_ahead} and min_bytes {min_bytes} must not be negative")
        self.store = store
        self.file = file
        self.memory = memory
        self.read_ahead = read_ahead
        self.min_bytes = min_bytes
        # Writes in flight hold at most this much staging (a quarter of the budget by default), so the
        # forward cannot crowd out the parameters' layer groups while the disk catches up.
        self.max_staging_bytes = max_staging_bytes if max_staging_bytes is not None else memory.capacity // 4
        self.stats = ActivationStats()
        self._lock = threading.RLock()
        # Writes in flight with their staging, oldest first. Waited for on the tickets themselves, not through
        # SwapStore.wait: its I/O wait is the parameters' and optimizer's, activation waits are counted here.
        self._writes: List = []
        self._regions: List = []  # extents of ``file``, filled in order each cycle
        self._cursor = (0, 0)  # (region, offset inside it) of the next tensor
        self._slots: List[_Slot] = []  # this cycle's live slots, in pack order
        self._live = 0
        self._cycle_wait0 = 0.0
        self._unpacking: set = set()  # slots whose staging an unpack is reading from now (ids)
        memory.add_reclaimer("activation write-behind (finished)", self._forget_finished, cheap=True)
        memory.add_reclaimer("activation write-behind", self._finish_one_write)
        memory.add_reclaimer("activation read-ahead", self._drop_one_read_ahead)
        memory.add_holder("activation staging", self.staging_bytes)

    # ------------------------------------------------------------------------------------------ hooks

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context under which a forward's saved tensors come here."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def worth_storing(self, t) -> bool:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_sparse:
            return False
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return False  # weights (and their transposes) are the parameter swapper's business
        if t.requires_grad and t.is_leaf:
            return False  # autograd needs such a tensor itself, not a copy
        return t.numel() * t.element_size() >= max(1, self.min_bytes)

    def pack(self, t):
        if not self.worth_storing(t):
            with self._lock:
                self.stats.tensors_kept += 1
            return t
        nbytes = t.numel() * t.element_size()
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)  # the tensor's bytes
        with self._lock:
            offset = self._allocate(nbytes)
            slot = _Slot(
                index=len(self._slots), offset=offset, nbytes=nbytes, shape=t.shape, dtype=t.dtype, device=t.device
            )
            for a, b in _pieces(nbytes):
                self._make_room(b - a)
                staging = self.memory.take(b - a, "activation staging")
                staging.copy_(src[a:b])
                try:
                    ticket = self.store.write_span(self.file, offset + a, staging, "activation")
                except OSError as e:
                    raise self._error("writing", slot, e) from e
                self._writes.append((ticket, staging))
            handle = StoredActivation(slot)
            slot.handle = weakref.ref(handle)
            weakref.finalize(handle, self._release, slot)
            self._slots.append(slot)
            self._live += 1
            self.stats.tensors_stored += 1
            self.stats.bytes_stored += nbytes
        return handle

    def unpack(self, handle):
        if not isinstance(handle, StoredActivation):
            return handle
        slot = handle.slot
        with self._lock:
            self._forget_finished()  # the forward's writes are done by now: their staging goes back
            if slot.read is None:
                self._start_read(slot, blocking=True)
            self._unpacking.add(id(slot))  # its staging must not be reclaimed while read from below
            self._read_ahead_of(slot)
            reads, buffers = slot.read, slot.buffer
        t0 = time.perf_counter()
        try:
            for r in reads:
                r.wait()
            waited = time.perf_counter() - t0
            out = torch.empty(slot.shape, dtype=slot.dtype, device=slot.device)
            flat = out.view(-1).view(torch.uint8)
            for (a, b), buf in zip(_pieces(slot.nbytes), buffers):
                flat[a:b].copy_(buf)
        except OSError as e:
            raise self._error("reading", slot, e) from e
        finally:
            with self._lock:
                self._unpacking.discard(id(slot))
        with self._lock:
            self.stats.read_wait_s += waited
            self.stats.bytes_read += slot.nbytes
            if slot.read is reads:  # the staging goes back now; a second unpack reads again
                slot.read, slot.buffer = None, None
        return out

    # --------------------------------------------------------------------------------------- internals

    def prefetch_last(self) -> None:
        """Start reading the last ``read_ahead`` stored tensors (the first the backward will need): call it
        when a forward ends."""
        with self._lock:
            self._forget_finished()
            if self._slots:
                last = self._slots[-1]
                if last.read is None:
                    self._start_read(last, blocking=False)
                self._read_ahead_of(last)

    def _start_read(self, slot: _Slot, blocking: bool) -> bool:
        pieces = _pieces(slot.nbytes)
        bufs = []
        for a, b in pieces:
            buf = self.memory.take(b - a, "activation read-back") if blocking else self.memory.try_take(b - a)
            if buf is None:
                return False  # the pieces taken so far go back with ``bufs``
            bufs.append(buf)
        tickets = []
        try:
            for (a, _), buf in zip(pieces, bufs):
                tickets.append(self.store.read_span(self.file, slot.offset + a, buf, "activation"))
        except OSError as e:
            _wait_quietly(tickets)
            raise self._error("reading", slot, e) from e
        slot.read, slot.buffer = tickets, bufs
        return True

    def _read_ahead_of(self, slot: _Slot) -> None:
        """Start reads of up to ``read_ahead`` live slots packed before ``slot`` (nearest first), without
        waiting for memory."""
        started = 0
        for prev in reversed(self._slots[: slot.index]):
            if started >= self.read_ahead:
                break
            if prev.handle is None or prev.handle() is None:
                continue
            if prev.read is None:
                if not self._start_read(prev, blocking=False):
                    break
                self.stats.reads_ahead += 1
            started += 1

    def _allocate(self, nbytes: int) -> int:
        reserved = align_up(nbytes)
        region, used = self._cursor
        while True:
            if region == len(self._regions):
                self._regions.append(self.file.allocate(max(reserved, REGION_BYTES)))
            extent = self._regions[region]
            if used + reserved <= extent.reserved:
                self._cursor = (region, used + reserved)
                return extent.offset + used
            region, used = region + 1, 0

    def _make_room(self, nbytes: int) -> None:
        self._forget_finished()
        t0 = time.perf_counter()
        while self._writes and self._write_bytes() + nbytes > self.max_staging_bytes:
            self._finish_one_write()
        self.stats.write_wait_s += time.perf_counter() - t0

    def _write_bytes(self) -> int:
        return sum(buf.numel() for _, buf in self._writes)

    def _forget_finished(self) -> bool:
        """Give back the staging of completed writes (raising if one failed); True if any was given back."""
        with self._lock:
            done, pending = [], []
            for w in self._writes:
                (done if w[0].done() else pending).append(w)
            if not done:
                return False
            self._writes = pending
            for ticket, _ in done:
                self._wait_write(ticket)
            return True

    def _finish_one_write(self) -> bool:
        """Wait for the oldest write and give its staging back; False when none is in flight."""
        with self._lock:
            if not self._writes:
                return False
            ticket, _ = self._writes.pop(0)
            self._wait_write(ticket)
            return True

    def _drop_one_read_ahead(self) -> bool:
        """Give back the staging of the read ahead that the backward needs last (the earliest packed); it is
        read again when the backward gets there. False when no read ahead holds staging. A long sequence's
        read-ahead must not starve what the backward cannot do without (its gradients' write-out)."""
        with self._lock:
            for slot in self._slots:
                if slot.buffer is None or id(slot) in self._unpacking:
                    continue
                # The kernel may still be filling the buffers; an error does not matter here: the read is
                # made again on demand, which reports it if it persists.
                _wait_quietly(slot.read)
                slot.read, slot.buffer = None, None
                self.stats.reads_dropped += 1
                return True
            return False

    def _wait_write(self, ticket: Ticket) -> None:
        try:
            ticket.wait()
        except OSError as e:
            raise self._error("writing", None, e) from e

    def _release(self, slot: _Slot) -> None:
        """Autograd let go of a handle (its backward ran, or the graph was dropped)."""
        with self._lock:
            if slot.read is not None:
                # The kernel may still be writing into the staging buffers: let it finish first. An error
                # no longer matters, nobody needs these bytes.
                _wait_quietly(slot.read)
                slot.read, slot.buffer = None, None
            self._live -= 1
            if self._live == 0:
                # Every handle of this cycle is gone: the next forward reuses the regions from the start.
                # (Overlapping requests still in flight are ordered by the SwapStore.)
                self._slots = []
                self._cursor = (0, 0)
                self.stats.cycles += 1
                self.stats.read_wait_s_cycles.append(self.stats.read_wait_s - self._cycle_wait0)
                self._cycle_wait0 = self.stats.read_wait_s

    def _error(self, doing: str, slot: Optional[_Slot], err: OSError) -> OSError:
        where = f" ({slot.nbytes} bytes at offset {slot.offset})" if slot is not None else ""
        return OSError(
            err.errno,
            f"{doing} activations saved for the backward in {self.file.path}{where} failed: "
            f"{err.strerror or err}; the step cannot finish: check the disk under "
            'aidaptiv.nvme_path, or set aidaptiv.activations.policy to "recompute"',
            self.file.path,
        )

    def staging_bytes(self) -> int:
        """Pool memory this store holds now (writes in flight, reads ahead)."""
        with self._lock:
            return self._write_bytes() + sum(s.nbytes for s in self._slots if s.buffer is not None)

    def writes_in_flight_bytes(self) -> int:
        """Staging held by writes not yet known to be complete."""
        with self._lock:
            return self._write_bytes()

    def stats_dict(self) -> dict:
        with self._lock:
            s = self.stats
            return {
                "tensors_stored": s.tensors_stored,
                "bytes_stored": s.bytes_stored,
                "bytes_read": s.bytes_read,
                "tensors_kept_in_memory": s.tensors_kept,
                "io_wait_s": s.read_wait_s,
                "write_wait_s": s.write_wait_s,
                "reads_ahead": s.reads_ahead,
                "reads_dropped": s.reads_dropped,
                "cycles": s.cycles,
                "io_wait_s_cycles": list(s.read_wait_s_cycles),
                "file_bytes": sum(r.reserved for r in self._regions),
            }
