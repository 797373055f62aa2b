"""Parameter partitions on NVMe, read and written a layer group at a time.

:class:`AidaptivParamSwapper` offers the interface DeepSpeed 0.19 expects of
``AsyncPartitionedParameterSwapper`` (``param.nvme_swapper``), so ZeRO-3's own status machine drives it:
DeepSpeed asks ``swap_in(params)`` for the partitions it is about to gather and calls
``remove_partition_and_release_buffers(params)`` when it is done with them.

Differences from DeepSpeed's swapper, and why:

- one file for all partitions of the rank, one 4 KiB-aligned extent each, laid out so that each layer group
  is contiguous on disk (relocated once at start if the model was built in another order);
- a layer group is read in one request into one buffer from the pinned pool; every partition of the group
  is a view into it. There is no buffer_count/buffer_size: a group takes what it needs from the budget;
- a partition DeepSpeed asks for waits only for its own group's request, never for unrelated prefetches;
- groups stay in host memory after use while the budget allows (least recently used go first), so the
  groups at the forward/backward turn are not read twice; updated partitions are written through to the
  cached copy and to disk;
- reads of a group never overlap a pending write of the same bytes (the store orders them).

Before :meth:`plan` (while the model is being built and DeepSpeed sets up its optimizer) there are no
groups: each partition moves alone through an ordinary aligned buffer.
"""
from __future__ import annotations

import itertools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from aidaptiv_ds.store import (Extent, HostBudgetError, SlotPool, Ticket, WriteBehind, aligned_empty,
                                as_bytes)

log = logging.getLogger(__name__)


class ParamStatus:
    """Mirrors deepspeed.runtime.swap_tensor.partitioned_param_swapper.PartitionedParamStatus (set by
    :mod:`aidaptiv_ds.zero3.install`, which is the only place that imports DeepSpeed)."""

    AVAILABLE = None
    NOT_AVAILABLE = None
    INFLIGHT = None


@dataclass(eq=False)
class ParamRecord:
    ds_id: int
    numel: int
    dtype: torch.dtype
    extent: Extent
    param: "weakref.ref"
    group: Optional["LayerGroup"] = None
    published: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(eq=False)
class LayerGroup:
    """Consecutive parameter partitions read and cached together."""

    index: int
    name: str
    records: List[ParamRecord]
    offset: int = 0          # span on disk
    nbytes: int = 0
    buffer: Optional[torch.Tensor] = None
    ticket: Optional[Ticket] = None
    users: int = 0           # partitions currently published to DeepSpeed
    last_used: int = 0
    pins: int = 0            # > 0 while a swap-in or the prefetch window needs it: not to be evicted
    writes: list = field(default_factory=list)  # tickets of write-throughs from this buffer
    slot: Optional[int] = None  # index of the slot holding the buffer (or the ghost)
    # Evicted while a write-through from its slot is in flight: the slot cannot be reused before that
    # write completes, and it holds exactly what the disk will hold, so a read of the group in that window
    # takes the slot back instead of waiting for the write and reading the same bytes again.
    ghost: bool = False

    def view(self, rec: ParamRecord) -> torch.Tensor:
        start = rec.extent.offset - self.offset
        return self.buffer[start:start + rec.nbytes].view(rec.dtype)


@dataclass(eq=False)
class MasterRun:
    """Consecutive pieces of partitions on disk (one layer group), in one host buffer."""

    lo: int
    hi: int
    group: Optional[LayerGroup]      # set when the group is cached: the buffer is a view of it
    buffer: Optional[torch.Tensor] = None
    ticket: Optional[Ticket] = None
    pinned: bool = False

    @staticmethod
    def plan(swapper, run) -> "MasterRun":
        lo = swapper.piece_span(run[0][0], run[0][1], run[0][2])[0]
        hi = swapper.piece_span(run[-1][0], run[-1][1], run[-1][2])[1]
        g = run[0][0].group
        cached = g is not None and g.buffer is not None
        return MasterRun(lo, hi, g if cached else None)

    def view(self, rec: ParamRecord, start: int, numel: int) -> torch.Tensor:
        es = rec.nbytes // rec.numel
        a = rec.extent.offset + start * es - self.lo
        return self.buffer[a:a + numel * es].view(rec.dtype)


def _empty(dtype):
    return torch.empty(0, dtype=dtype)


class AidaptivParamSwapper:
    """DeepSpeed's parameter-swapper interface on our store. One per ``zero.Init`` / model."""

    def __init__(self, runtime):
        self.runtime = runtime
        runtime.param_swapper = self
        self.dtype = runtime.model_dtype
        self.swap_folder = runtime.space.path
        self.records: Dict[int, ParamRecord] = {}
        self.groups: List[LayerGroup] = []
        self.planned = False
        self.slot_bytes = 0  # host buffer size of every layer group (the largest group's span)
        self._lock = threading.RLock()
        self._clock = itertools.count(1)
        self._init_buffers: Dict[int, torch.Tensor] = {}
        self._inflight_params: list = []
        # Updated partitions being written: staging buffers (finishing frees them) or views of a cached
        # group (finishing frees nothing).
        self._write_behind = WriteBehind(self.runtime.store)
        self.invalid_buffer = _empty(self.dtype)

    # ---------------------------------------------------------------- DeepSpeed's interface
    def swappable_tensor(self, param=None, numel=None):
        # Every partition goes to NVMe, however small: small ones travel inside their layer group.
        return True

    def available_swap_in_buffers(self):
        # Only DeepSpeed's own NVMe prefetch asks; it is switched off (our prefetcher replaces it).
        return 1 << 30

    def get_path(self, param, must_exist=False):
        return self.runtime.params_file.path

    def get_buffer(self, param, numel):
        """First partitioning of ``param`` (model construction): allocate its extent and hand DeepSpeed an
        aligned buffer to fill; :meth:`swap_out_and_release` writes it."""
        with self._lock:
            rec = self.records.get(param.ds_id)
            if rec is None:
                nbytes = numel * torch.empty(0, dtype=param.dtype).element_size()
                ext = self.runtime.params_file.allocate(nbytes)
                rec = ParamRecord(param.ds_id, numel, param.dtype, ext, weakref.ref(param))
                self.records[param.ds_id] = rec
            buf = aligned_empty(rec.extent.reserved)
            self._init_buffers[param.ds_id] = buf
            return buf[:rec.nbytes].view(rec.dtype)

    def swap_out_and_release(self, params, async_op=False, force_buffer_release=False):
        """Write partitions that DeepSpeed filled through :meth:`get_buffer`, then release them."""
        tickets = []
        with self._lock:
            for p in params:
                rec = self.records[p.ds_id]
                buf = self._init_buffers.pop(p.ds_id, None)
                if buf is None:  # a published partition being swapped out: write its current values
                    buf = aligned_empty(rec.extent.reserved)
                    as_bytes(buf[:rec.nbytes]).copy_(as_bytes(p.ds_tensor.data))
                tickets.append((self.runtime.store.write_span(rec.extent.file, rec.extent.offset, buf,
                                                              f"partition {p.ds_id}"), buf))
        for t, _ in tickets:
            self.runtime.store.wait(t)
        self.remove_partition_and_release_buffers(params)

    def swap_in(self, params, async_op=True, swap_in_buffers=None):
        """Make the partitions of ``params`` available. With ``async_op`` their groups start loading and
        the partitions are marked in flight; :meth:`synchronize_reads` finishes them (DeepSpeed's
        contract). Otherwise this returns with them published. A partition waits for its own group's
        request only, never for unrelated prefetches."""
        if swap_in_buffers is not None:
            for p, buf in zip(params, swap_in_buffers):
                self.swap_into_buffer(p, buf)
            return
        if not async_op:
            self._publish(params)
            return
        with self._lock:
            for p in params:
                rec = self.records[p.ds_id]
                if rec.published:
                    continue
                if rec.group is not None:
                    rec.group.pins += 1
                    self._ensure_loading(rec.group, blocking=True, reason=f"partition {p.ds_id}")
                p.ds_tensor.status = ParamStatus.INFLIGHT
                self._inflight_params.append(p)

    def synchronize_reads(self):
        with self._lock:
            params, self._inflight_params = self._inflight_params, []
            self._publish(params)
            for p in params:
                g = self.records[p.ds_id].group
                if g is not None:
                    g.pins -= 1

    def synchronize_writes(self):
        self.drain_writes()

    def remove_partition_and_release_buffers(self, params):
        with self._lock:
            for p in params:
                rec = self.records.get(p.ds_id)
                if rec is not None and rec.published:
                    rec.published = False
                    g = rec.group
                    if g is not None:
                        g.users -= 1
                        g.last_used = next(self._clock)
                p.ds_tensor.data = _empty(p.ds_tensor.dtype)
                p.ds_tensor.status = ParamStatus.NOT_AVAILABLE

    def swap_into_buffer(self, param, dest_buffer):
        """Copy ``param``'s partition into ``dest_buffer`` without publishing it."""
        rec = self.records[param.ds_id]
        with self._lock:
            if self.runtime.optimizer_swapper is not None:
                self.runtime.optimizer_swapper.apply_pending(rec.ds_id)
            if rec.group is not None:
                self._ensure_loading(rec.group, blocking=True, reason=f"partition {param.ds_id}")
                self._wait_group(rec.group)
                src = rec.group.view(rec)
            else:
                src = self._read_alone(rec)
            dest_buffer.data.copy_(src)

    def reserve_partitioned_swap_space(self, partition_num_elems):
        pass  # buffers for updated partitions come from the pool when they are written

    def reserve_available_buffers(self):
        return []  # only DeepSpeed's fast_init path uses these; we configure fast_init off

    def release_reserved_buffers(self):
        pass

    def swap_out_partitioned_params(self, dst_fp16_params, src_fp32_params):
        """Write whole updated partitions (DeepSpeed's interface; the streamed step uses write_pieces)."""
        self.write_pieces([(self.records[p.ds_id], 0, self.records[p.ds_id].numel, src)
                           for p, src in zip(dst_fp16_params, src_fp32_params)])

    @staticmethod
    def piece_span(rec: ParamRecord, start: int, numel: int):
        """Bytes [lo, hi) on disk of elements [start, start+numel) of a partition: ``start`` is at 4 KiB of
        the partition's bytes, and a piece that ends the partition runs to the end of its extent."""
        es = rec.nbytes // rec.numel
        lo = rec.extent.offset + start * es
        hi = rec.extent.end if start + numel == rec.numel else lo + numel * es
        return lo, hi

    def _runs(self, pieces) -> List[list]:
        """Pieces (record, start, numel, ...) sorted and grouped into runs adjacent on disk and in the same
        layer group, each of which is one read or write."""
        pieces = sorted(pieces, key=lambda p: (p[0].extent.offset, p[1]))
        runs: List[list] = []
        for p in pieces:
            if runs:
                q = runs[-1][-1]
                if self.piece_span(q[0], q[1], q[2])[1] == self.piece_span(p[0], p[1], p[2])[0] \
                        and q[0].group is p[0].group:
                    runs[-1].append(p)
                    continue
            runs.append([p])
        return runs

    def write_pieces(self, pieces) -> None:
        """Write updated values of partitions: ``pieces`` are (record, first element, numel, fp32 source).
        Values are converted to the model dtype, written into the layer group's cached copy when it is in
        host memory (write-through) and to disk behind the step; a later read of the same bytes waits."""
        mem = self.runtime.memory
        with self._lock:
            for run in self._runs(pieces):
                r = MasterRun.plan(self, run)
                g = run[0][0].group
                if r.group is not None:
                    # Write through: a read of the cached copy still in flight must land first, or it would
                    # bring back old values.
                    self._wait_group(r.group)
                    r.buffer = r.group.buffer[r.lo - r.group.offset:r.hi - r.group.offset]
                elif g is not None and g.ghost:
                    # Evicted while a write-through from its slot is in flight: the next read of the group
                    # takes that slot back as it is, so these bytes must land in it too. Written from the
                    # slot, the write also keeps the slot from being given away before it completes.
                    r.group = g
                    r.buffer = self.slots.view(g.slot, g.nbytes)[r.lo - g.offset:r.hi - g.offset]
                else:
                    r.buffer = mem.take(r.hi - r.lo, "writing updated parameters") if mem is not None \
                        else aligned_empty(r.hi - r.lo)
                for rec, start, numel, src in run:
                    r.view(rec, start, numel).copy_(src.reshape(-1))
                self.store_run(r)

    def load_run(self, run, blocking: bool) -> Optional["MasterRun"]:
        """Bring a run of pieces (record, start, numel, ...) into host memory to be updated in place (the
        fp32 master of an fp32 model is the parameter itself). The run's layer group is loaded into the
        group cache (or found there) and the run is a view of it, so the forward that comes next reads
        nothing more. None when not blocking and the budget has no room now."""
        with self._lock:
            r = MasterRun.plan(self, run)
            g = run[0][0].group
            if g is not None:
                g.pins += 1  # not to be evicted while the step updates it in place
                if not self._ensure_loading(g, blocking, reason="optimizer step"):
                    g.pins -= 1
                    return None
                r.group, r.pinned = g, True
                r.buffer = g.buffer[r.lo - g.offset:r.hi - g.offset]
                return r
            mem = self.runtime.memory
            buf = mem.take(r.hi - r.lo, "fp32 master weights") if blocking else mem.try_take(r.hi - r.lo)
            if buf is None:
                return None
            r.buffer = buf
            r.ticket = self.runtime.store.read_span(run[0][0].extent.file, r.lo, buf,
                                                    f"master weights {run[0][0].ds_id}..{run[-1][0].ds_id}")
            return r

    def wait_run(self, r: "MasterRun") -> None:
        if r.group is not None:
            self._wait_group(r.group)
        elif r.ticket is not None:
            self.runtime.store.wait(r.ticket)
            r.ticket = None

    def store_run(self, r: "MasterRun") -> None:
        """Write a run back (behind the caller) and let go of it."""
        with self._lock:
            t = self.runtime.store.write_span(self.runtime.params_file, r.lo, r.buffer,
                                              f"updated partitions from {r.lo}")
            # A view of a cached group frees nothing when written; a staging buffer does.
            self._write_behind.add(t, r.buffer, r.group is None)
            if r.group is not None:
                r.group.writes.append(t)
            if r.pinned:
                r.group.pins -= 1
                r.pinned = False

    def release_run(self, r: "MasterRun") -> None:
        """Let go of a run without writing it (an error half-way through the step)."""
        with self._lock:
            self.wait_run(r)
            if r.pinned:
                r.group.pins -= 1
                r.pinned = False
            r.buffer = None

    # ---------------------------------------------------------------- groups
    def plan(self, module, layer_group_size: int, slots: int) -> None:
        """Form layer groups from the module structure, make each contiguous on disk, carve ``slots``
        group buffers from the pinned pool and switch to grouped I/O. Called once the runtime has its
        pinned pool."""
        from aidaptiv_ds.zero3.layer_groups import partition_into_groups
        with self._lock:
            named = partition_into_groups(module, layer_group_size)
            seen = set()
            for index, (name, params) in enumerate(named):
                recs = []
                for p in params:
                    if p.ds_id in seen or p.ds_id not in self.records:
                        continue  # tied weights live in their first group; persistent params are not ours
                    seen.add(p.ds_id)
                    recs.append(self.records[p.ds_id])
                if recs:
                    self.groups.append(LayerGroup(len(self.groups), name, recs))
            # Partitions DeepSpeed knows but the module walk did not reach (rare): one group at the end.
            rest = [r for i, r in self.records.items() if i not in seen]
            if rest:
                self.groups.append(LayerGroup(len(self.groups), "other", rest))
            for g in self.groups:
                self._make_contiguous(g)
                for r in g.records:
                    r.group = g
            # Layer groups live in equal slots of the largest group's size, carved from the pool once: any
            # free slot fits any group, so groups coming and going in LRU order can never leave the memory
            # cut into pieces too small for the next one (the pool cannot move live buffers).
            self.slot_bytes = max(g.nbytes for g in self.groups)
            self.slots = SlotPool(self.runtime.memory, slots, self.slot_bytes)
            self.runtime.memory.add_reclaimer("finished parameter writes", self._forget_finished_writes, cheap=True)
            self.runtime.memory.add_reclaimer("parameter write-behind", self._reclaim_write)
            self.runtime.memory.add_holder("layer-group slots", lambda: self.slots.region.numel())
            self.runtime.memory.add_holder("parameter writes", self._write_behind.held_bytes)
            self.planned = True

    def _make_contiguous(self, g: LayerGroup) -> None:
        recs = sorted(g.records, key=lambda r: r.extent.offset)
        contiguous = all(a.extent.end == b.extent.offset for a, b in zip(recs, recs[1:]))
        if not contiguous:
            # Relocate: one new span, each partition copied into place (once, at start).
            total = sum(r.extent.reserved for r in g.records)
            f = self.runtime.params_file
            span = f.allocate(total)
            off = span.offset
            moved = []
            for r in g.records:
                buf = aligned_empty(r.extent.reserved)
                self.runtime.store.wait(self.runtime.store.read_span(r.extent.file, r.extent.offset, buf,
                                                                     f"relocating partition {r.ds_id}"))
                self.runtime.store.wait(self.runtime.store.write_span(f, off, buf, f"relocating {r.ds_id}"))
                moved.append((r, Extent(f, off, r.extent.nbytes)))
                off += r.extent.reserved
            for r, ext in moved:
                f.release(r.extent)
                r.extent = ext
            recs = list(g.records)
            log.debug("relocated layer group %s to be contiguous on disk", g.name)
        g.records = recs
        g.offset = recs[0].extent.offset
        g.nbytes = recs[-1].extent.end - g.offset

    def _ensure_loading(self, g: LayerGroup, blocking: bool, reason: str) -> bool:
        """Start reading ``g`` unless it is in host memory or on its way. Returns False only when not
        blocking and the budget has no room now."""
        if g.buffer is not None:
            if g.ticket is None:
                self.runtime.stats.group_hits += 1
            return True
        if g.ghost:
            g.writes = [t for t in g.writes if not t.done()]
            g.ghost = False
            if g.writes:  # still being written: the bytes are in its slot, take it back
                g.buffer = self.slots.view(g.slot, g.nbytes)
                g.last_used = next(self._clock)
                self.runtime.stats.group_hits += 1
                return True
            self.slots.give(g.slot)
            g.slot = None
        g.pins += 1
        try:
            slot = self._take_slot(blocking, f"layer group {g.name} ({reason})")
        finally:
            g.pins -= 1
        if slot is None:
            return False
        g.slot = slot
        buf = self.slots.view(slot, g.nbytes)
        g.buffer = buf
        g.ticket = self.runtime.store.read_span(self.runtime.params_file, g.offset, g.buffer, f"layer group {g.name}")
        g.last_used = next(self._clock)
        self.runtime.stats.group_reads += 1
        return True

    def _wait_group(self, g: LayerGroup) -> None:
        if g.ticket is not None:
            t = g.ticket
            if not t.done():
                self.runtime.stats.sync_param_reads += 1
            self.runtime.store.wait(t)
            g.ticket = None

    def _publish(self, params) -> None:
        """Wait for each partition's group (loading it if needed) and hand DeepSpeed a view into it, with
        any optimizer update still pending for it applied first."""
        osw = self.runtime.optimizer_swapper
        with self._lock:
            for p in params:
                rec = self.records[p.ds_id]
                if rec.published:
                    continue
                if osw is not None and osw.pending():
                    osw.apply_pending(rec.ds_id)
                g = rec.group
                if g is None:
                    data = self._read_alone(rec)
                else:
                    g.pins += 1
                    try:
                        self._ensure_loading(g, blocking=True, reason=f"partition {p.ds_id}")
                        self._wait_group(g)
                    finally:
                        g.pins -= 1
                    data = g.view(rec)
                    g.users += 1
                    g.last_used = next(self._clock)
                p.ds_tensor.data = data
                p.ds_tensor.status = ParamStatus.AVAILABLE
                rec.published = True

    def _read_alone(self, rec: ParamRecord) -> torch.Tensor:
        buf = aligned_empty(rec.extent.reserved)
        self.runtime.store.wait(self.runtime.store.read_span(rec.extent.file, rec.extent.offset, buf,
                                                             f"partition {rec.ds_id}"))
        return buf[:rec.nbytes].view(rec.dtype)

    def prefetch(self, groups: List[LayerGroup]) -> None:
        """Start reading ``groups`` (nearest first) as far as the budget allows without waiting."""
        with self._lock:
            for g in groups:
                g.pins += 1
            try:
                for g in groups:
                    if g.buffer is None:
                        if not self._ensure_loading(g, blocking=False, reason="prefetch"):
                            break
                        self.runtime.stats.prefetched_groups += 1
            finally:
                for g in groups:
                    g.pins -= 1

    def _take_slot(self, blocking: bool, what: str) -> Optional[int]:
        """A free slot; else the slot of the least recently used cached group nobody uses (never waiting
        for I/O); when blocking, also a slot freed by waiting for a write-through to finish."""
        while True:
            slot = self.slots.take()
            if slot is not None:
                return slot
            if self._evict_group():
                continue
            if blocking and self._finish_a_ghost_write():
                continue
            if not blocking:
                return None
            in_use = [g.name for g in self.groups if g.buffer is not None and (g.users or g.pins)]
            raise HostBudgetError(
                f"host memory budget exhausted: {what} needs one of the {self.slots.count} layer-group slots "
                f"({self.slot_bytes / 2**20:.1f} MiB each) but all are in use ({', '.join(in_use)}): raise "
                "aidaptiv.host_memory_budget or lower aidaptiv.layer_group_size")

    def _evict_group(self) -> bool:
        """Drop the least recently used cached group that nobody uses, no prefetch protects and no read is
        still filling. Its slot is free at once unless a write-through from it is in flight (a ghost)."""
        victims = [g for g in self.groups if g.buffer is not None and g.users == 0 and g.pins == 0
                   and (g.ticket is None or g.ticket.done())]
        if not victims:
            return False
        for g in victims:
            g.writes = [t for t in g.writes if not t.done()]
        # Groups still being written out free nothing now: evict those last.
        g = min(victims, key=lambda x: (bool(x.writes), x.last_used))
        if g.ticket is not None:
            self.runtime.store.wait(g.ticket)  # finished: raises if the read failed
            g.ticket = None
        g.buffer = None
        if g.writes:
            g.ghost = True
            return self._drop_finished_ghosts()
        self.slots.give(g.slot)
        g.slot = None
        return True

    def _finish_a_ghost_write(self) -> bool:
        for g in self.groups:
            if g.ghost:
                for t in g.writes:
                    self.runtime.store.wait(t)
                return self._drop_finished_ghosts()
        return False

    def _forget_finished_writes(self) -> bool:
        with self._lock:
            self._drop_finished_ghosts()
            return self._write_behind.forget_finished()

    def _reclaim_write(self) -> bool:
        """Finish the oldest write-behind of updated partitions and free its buffer."""
        with self._lock:
            return self._write_behind.finish_oldest(after_each=self._drop_finished_ghosts)

    def drain_writes(self) -> None:
        self._write_behind.finish_all(self._lock)

    def _drop_finished_ghosts(self) -> bool:
        """Give back the slots of evicted groups whose write-throughs have finished."""
        dropped = False
        for g in self.groups:
            if g.ghost and all(t.done() for t in g.writes):
                g.ghost, g.writes = False, []
                self.slots.give(g.slot)
                g.slot = None
                dropped = True
        return dropped

    def poll_writes(self) -> None:
        """Forget finished write-behinds so their buffers return to the pool (raising if one failed)."""
        self._forget_finished_writes()

    def drop_cache(self) -> None:
        """Forget every cached group (after a checkpoint load replaced the bytes on disk)."""
        with self._lock:
            self.drain_writes()
            for g in self.groups:
                if g.ticket is not None:
                    self.runtime.store.wait(g.ticket)
                    g.ticket = None
                if g.users == 0:
                    g.buffer = None
                    g.ghost, g.writes = False, []
                    if g.slot is not None:
                        self.slots.give(g.slot)
                        g.slot = None
