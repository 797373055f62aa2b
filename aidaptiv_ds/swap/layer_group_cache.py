"""Layer groups of parameter partitions cached in equal host slots, read, prefetched and written through.

A *layer group* is a run of parameter partitions that is contiguous on disk and moves as one request into
one slot; every partition of the group is a view into that slot. :class:`LayerGroupCache` keeps groups in
host memory after use while slots allow (the least recently used go first), so the groups at the
forward/backward turn are not read twice, and lets the optimizer step update a group in place and write it
through to disk.

Bookkeeping of a group, all under :attr:`LayerGroupCache.lock`:

- ``users``: partitions of the group currently handed out (:meth:`~LayerGroupCache.publish`); such a group
  is never evicted;
- ``pins``: a swap-in, a prefetch window or an optimizer update needs the group; not evicted either;
- ``held``: a retained group (one of the last ``retain`` of the forward, :meth:`~LayerGroupCache.plan`)
  that the forward has used and the backward not yet: it holds one pin, so it stays in its slot across
  the forward/backward turn and the backward does not read it again;
- ``writes``: write-throughs from its slot still in flight. A group evicted while it has some is a *ghost*:
  its slot cannot be reused before those writes complete, and it holds exactly what the disk will hold, so
  a read of the group in that window takes the slot back instead of reading the same bytes again, and an
  update written to a ghost goes into its slot too.

Reads of a group never overlap a pending write of the same bytes: the store orders them. The records it
keeps are those of :mod:`aidaptiv_ds.swap.partition_layout`. The cache knows nothing of DeepSpeed;
:mod:`aidaptiv_ds.zero3.param_swapper` maps DeepSpeed's calls onto it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import List, Optional, Sequence, Tuple

from aidaptiv_ds.swap.host_memory import (
    HostBudgetError,
    SlotPool,
    WriteBehind,
    aligned_empty,
)
from aidaptiv_ds.swap.partition_layout import (
    LayerGroup,
    MasterRun,
    ParamRecord,
    piece_span,
)
from aidaptiv_ds.swap.space import Extent

log = logging.getLogger(__name__)


class LayerGroupCache:
    """Layer groups of one parameter swap file, cached in equal slots of host memory.

    ``store`` moves the bytes, ``params_file`` is the swap file the records' extents are in, and ``stats``
    receives the counters ``group_reads``, ``group_hits``, ``prefetched_groups`` and ``sync_param_reads``.
    Host memory comes with :meth:`plan`, since the pinned pool exists only once training starts; before
    that there are no groups, and written partitions go through ordinary aligned buffers.

    :attr:`lock` (reentrant) guards every group's bookkeeping. The methods take it, except
    :meth:`ensure_loading` (a step of the others: its caller holds it), :meth:`wait_group` and
    :meth:`wait_run`, which only wait for a read and forget its ticket, and :meth:`drain_writes`, which
    waits outside it. A caller holds it across several calls that must see the cache unchanged in between.
    """

    def __init__(self, store, params_file, stats):
        self.store = store
        self.params_file = params_file
        self.stats = stats
        self.memory = None
        self.groups: List[LayerGroup] = []
        self.slots: Optional[SlotPool] = None
        self.slot_bytes = 0  # host buffer size of every layer group (the largest group's span)
        self.planned = False
        self.retain_from = 0  # index of the first retained group (len(groups): none)
        self.lock = threading.RLock()
        self._clock = itertools.count(1)
        # Updated partitions being written: staging buffers (finishing frees them) or views of a cached
        # group (finishing frees nothing).
        self._write_behind = WriteBehind(store)

    # ---------------------------------------------------------------- set-up
    def plan(self, named_records: Sequence[Tuple[str, List[ParamRecord]]], memory, slots: int, retain: int = 0) -> None:
        """Form one layer group of each ``(name, records)`` (in forward order), make each contiguous on
        disk, carve ``slots`` group buffers from ``memory`` (a store.HostMemory) and switch to grouped I/O.
        The last ``retain`` groups are retained across the forward/backward turn (:meth:`note_use`); the
        plan counts one of the ``slots`` for each."""
        with self.lock:
            for name, recs in named_records:
                self.groups.append(LayerGroup(len(self.groups), name, list(recs)))
            for g in self.groups:
                self._make_contiguous(g)
                for r in g.records:
                    r.group = g
            # Layer groups live in equal slots of the largest group's size, carved from the pool once: any
            # free slot fits any group, so groups coming and going in LRU order can never leave the memory
            # cut into pieces too small for the next one (the pool cannot move live buffers).
            self.memory = memory
            self.slot_bytes = max(g.nbytes for g in self.groups)
            self.slots = SlotPool(memory, slots, self.slot_bytes)
            self.retain_from = len(self.groups) - min(retain, len(self.groups))
            self.stats.retained_groups = len(self.groups) - self.retain_from
            self.stats.retained_bytes = sum(g.nbytes for g in self.groups[self.retain_from :])
            memory.add_reclaimer("finished parameter writes", self._forget_finished_writes, cheap=True)
            memory.add_reclaimer("parameter write-behind", self._reclaim_write)
            memory.add_holder("layer-group slots", lambda: self.slots.region.numel())
            memory.add_holder("parameter writes", self._write_behind.held_bytes)
            self.planned = True

    def _make_contiguous(self, g: LayerGroup) -> None:
        recs = sorted(g.records, key=lambda r: r.extent.offset)
        contiguous = all(a.extent.end == b.extent.offset for a, b in zip(recs, recs[1:]))
        if not contiguous:
            # Relocate: one new span, each partition copied into place (once, at start).
            total = sum(r.extent.reserved for r in g.records)
            f = self.params_file
            span = f.allocate(total)
            off = span.offset
            moved = []
            for r in g.records:
                buf = aligned_empty(r.extent.reserved)
                self.store.wait(
                    self.store.read_span(r.extent.file, r.extent.offset, buf, f"relocating partition {r.ds_id}")
                )
                self.store.wait(self.store.write_span(f, off, buf, f"relocating {r.ds_id}"))
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

    # ---------------------------------------------------------------- reading groups
    def ensure_loading(self, g: LayerGroup, blocking: bool, reason: str) -> bool:
        """Start reading ``g`` unless it is in host memory or on its way. Returns False only when not
        blocking and no slot is free now. ``reason`` names the caller in an exhaustion error."""
        if g.buffer is not None:
            if g.ticket is None:
                self.stats.group_hits += 1
            return True
        if g.ghost:
            g.writes = [t for t in g.writes if not t.done()]
            g.ghost = False
            if g.writes:  # still being written: the bytes are in its slot, take it back
                g.buffer = self.slots.view(g.slot, g.nbytes)
                g.last_used = next(self._clock)
                self.stats.group_hits += 1
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
        g.ticket = self.store.read_span(self.params_file, g.offset, g.buffer, f"layer group {g.name}")
        g.last_used = next(self._clock)
        self.stats.group_reads += 1
        self.stats.group_read_bytes += g.nbytes
        return True

    def wait_group(self, g: LayerGroup) -> None:
        """Wait for the read of ``g`` started by :meth:`ensure_loading`, if it is still pending."""
        if g.ticket is not None:
            t = g.ticket
            if not t.done():
                self.stats.sync_param_reads += 1
            self.store.wait(t)
            g.ticket = None

    def start_loading(self, g: LayerGroup, reason: str) -> None:
        """Pin ``g`` and start reading it (an asynchronous swap-in); :meth:`unpin` ends the pin."""
        with self.lock:
            g.pins += 1
            self.ensure_loading(g, blocking=True, reason=reason)

    def unpin(self, g: LayerGroup) -> None:
        with self.lock:
            g.pins -= 1

    def load(self, g: LayerGroup, reason: str) -> None:
        """Bring ``g`` into host memory and wait for it, without publishing anything."""
        with self.lock:
            self.ensure_loading(g, blocking=True, reason=reason)
            self.wait_group(g)

    def publish(self, g: LayerGroup, reason: str) -> None:
        """Bring ``g`` into host memory, wait for it and count one more user; :meth:`unpublish` ends the use."""
        with self.lock:
            g.pins += 1
            try:
                self.ensure_loading(g, blocking=True, reason=reason)
                self.wait_group(g)
            finally:
                g.pins -= 1
            g.users += 1
            g.last_used = next(self._clock)

    def unpublish(self, g: LayerGroup) -> None:
        """One user fewer; the group is now the most recently used. On an accelerator the copies of its
        partitions to the device may still be running: the slot's fence records them."""
        with self.lock:
            g.users -= 1
            g.last_used = next(self._clock)
            if g.slot is not None:
                self.slots.device_reads_issued(g.slot)

    def note_use(self, g: LayerGroup, backward: bool) -> None:
        """``g`` was just published by the forward (``backward`` False) or the backward. A retained group
        used by the forward is held (one pin) until the backward's first use of it, which then found it
        in memory instead of reading it: that use is counted as a read avoided."""
        if g.index < self.retain_from:
            return
        with self.lock:
            if not backward and not g.held:
                g.held = True
                g.pins += 1
            elif backward and g.held:
                g.held = False
                g.pins -= 1
                self.stats.retention_hits += 1
                self.stats.retention_avoided_read_bytes += g.nbytes

    def prefetch(self, groups: List[LayerGroup]) -> None:
        """Start reading ``groups`` (nearest first) as far as free or evictable slots allow without waiting.
        The whole window is pinned meanwhile, so loading a far group never evicts a near one."""
        with self.lock:
            for g in groups:
                g.pins += 1
            try:
                for g in groups:
                    if g.buffer is None:
                        if not self.ensure_loading(g, blocking=False, reason="prefetch"):
                            break
                        self.stats.prefetched_groups += 1
            finally:
                for g in groups:
                    g.pins -= 1

    # ---------------------------------------------------------------- slots and eviction
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
                "aidaptiv.host_memory_budget or lower aidaptiv.layer_group_size"
            )

    def _evict_group(self) -> bool:
        """Drop the least recently used cached group that nobody uses, no pin protects and no read is
        still filling. Its slot is free at once unless a write-through from it is in flight (a ghost)."""
        victims = [
            g
            for g in self.groups
            if g.buffer is not None and g.users == 0 and g.pins == 0 and (g.ticket is None or g.ticket.done())
        ]
        if not victims:
            return False
        for g in victims:
            g.writes = [t for t in g.writes if not t.done()]
        # Groups still being written out free nothing now: evict those last.
        g = min(victims, key=lambda x: (bool(x.writes), x.last_used))
        if g.ticket is not None:
            self.store.wait(g.ticket)  # finished: raises if the read failed
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
                    self.store.wait(t)
                return self._drop_finished_ghosts()
        return False

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

    # ---------------------------------------------------------------- updates: runs of pieces
    @staticmethod
    def runs(pieces) -> List[list]:
        """Pieces (record, start, numel, ...) sorted and grouped into runs adjacent on disk and in the same
        layer group, each of which is one read or write (a :class:`MasterRun`)."""
        pieces = sorted(pieces, key=lambda p: (p[0].extent.offset, p[1]))
        runs: List[list] = []
        for p in pieces:
            if runs:
                q = runs[-1][-1]
                if piece_span(q[0], q[1], q[2])[1] == piece_span(p[0], p[1], p[2])[0] and q[0].group is p[0].group:
                    runs[-1].append(p)
                    continue
            runs.append([p])
        return runs

    def write_pieces(self, pieces) -> None:
        """Write updated values of partitions: ``pieces`` are (record, first element, numel, source).
        Values are converted to the partition's dtype, written into the layer group's cached copy when it
        is in host memory (write-through) and to disk behind the caller; a later read of the same bytes
        waits."""
        mem = self.memory
        with self.lock:
            for run in self.runs(pieces):
                r = MasterRun.plan(run)
                g = run[0][0].group
                if r.group is not None:
                    # Write through: a read of the cached copy still in flight must land first, or it would
                    # bring back old values; a copy from it to the device, or it would take new ones.
                    self.wait_group(r.group)
                    self.slots.before_change(r.group.slot)
                    r.buffer = r.group.buffer[r.lo - r.group.offset : r.hi - r.group.offset]
                elif g is not None and g.ghost:
                    # Evicted while a write-through from its slot is in flight: the next read of the group
                    # takes that slot back as it is, so these bytes must land in it too. Written from the
                    # slot, the write also keeps the slot from being given away before it completes.
                    r.group = g
                    self.slots.before_change(g.slot)
                    r.buffer = self.slots.view(g.slot, g.nbytes)[r.lo - g.offset : r.hi - g.offset]
                else:
                    r.buffer = (
                        mem.take(r.hi - r.lo, "writing updated parameters")
                        if mem is not None
                        else aligned_empty(r.hi - r.lo)
                    )
                for rec, start, numel, src in run:
                    r.view(rec, start, numel).copy_(src.reshape(-1))
                self.store_run(r)

    def load_run(self, run, blocking: bool) -> Optional[MasterRun]:
        """Bring a run of pieces (record, start, numel, ...) into host memory to be updated in place (the
        fp32 master of an fp32 model is the parameter itself). The run's layer group is loaded into the
        cache (or found there), pinned, and the run is a view of it, so the forward that comes next reads
        nothing more. None when not blocking and the budget has no room now.

        When blocking and every slot is held by groups in use (a deferred update applied while the forward
        holds the groups it fetched, and the chunk reaches into one more group), the run is read into a
        staging buffer instead, as for partitions outside any group; :meth:`store_run` then also refreshes a
        copy of the group cached meanwhile."""
        with self.lock:
            r = MasterRun.plan(run)
            g = run[0][0].group
            if g is not None:
                g.pins += 1  # not to be evicted while the step updates it in place
                try:
                    loading = self.ensure_loading(g, blocking, reason="optimizer step")
                except HostBudgetError:
                    g.pins -= 1
                    return self._stage_run(run, r, g)
                if not loading:
                    g.pins -= 1
                    return None
                r.group, r.pinned = g, True
                self.slots.before_change(g.slot)  # the step updates the slot in place
                r.buffer = g.buffer[r.lo - g.offset : r.hi - g.offset]
                return r
            return self._stage_run(run, r, None, blocking)

    def _stage_run(self, run, r: MasterRun, home: Optional[LayerGroup], blocking: bool = True) -> Optional[MasterRun]:
        """Read run ``r`` into a buffer of its own (None when not blocking and the budget has no room now)."""
        with self.lock:
            mem = self.memory
            buf = mem.take(r.hi - r.lo, "fp32 master weights") if blocking else mem.try_take(r.hi - r.lo)
            if buf is None:
                return None
            r.buffer, r.home = buf, home
            r.ticket = self.store.read_span(
                run[0][0].extent.file, r.lo, buf, f"master weights {run[0][0].ds_id}..{run[-1][0].ds_id}"
            )
            return r

    def wait_run(self, r: MasterRun) -> None:
        """Wait until the bytes of a run from :meth:`load_run` are in host memory."""
        if r.group is not None:
            self.wait_group(r.group)
        elif r.ticket is not None:
            self.store.wait(r.ticket)
            r.ticket = None

    def store_run(self, r: MasterRun) -> None:
        """Write a run back (behind the caller) and let go of it."""
        with self.lock:
            g = r.home
            if r.group is None and g is not None and g.buffer is not None:
                # Staged while its group had no slot, and the group was read into one since (a read-ahead):
                # that copy was read before this write, so it gets the updated bytes here.
                self.wait_group(g)
                self.slots.before_change(g.slot)
                g.buffer[r.lo - g.offset : r.hi - g.offset].copy_(r.buffer[: r.hi - r.lo])
            t = self.store.write_span(self.params_file, r.lo, r.buffer, f"updated partitions from {r.lo}")
            # A view of a cached group frees nothing when written; a staging buffer does.
            self._write_behind.add(t, r.buffer, r.group is None)
            if r.group is not None:
                r.group.writes.append(t)
            if r.pinned:
                r.group.pins -= 1
                r.pinned = False

    def release_run(self, r: MasterRun) -> None:
        """Let go of a run without writing it (an error half-way through the step)."""
        with self.lock:
            self.wait_run(r)
            if r.pinned:
                r.group.pins -= 1
                r.pinned = False
            r.buffer = None

    # ---------------------------------------------------------------- write-behind
    def _forget_finished_writes(self) -> bool:
        with self.lock:
            self._drop_finished_ghosts()
            return self._write_behind.forget_finished()

    def _reclaim_write(self) -> bool:
        """Finish the oldest write-behind of updated partitions and free its buffer."""
        with self.lock:
            return self._write_behind.finish_oldest(after_each=self._drop_finished_ghosts)

    def drain_writes(self) -> None:
        """Wait for every write of updated partitions."""
        self._write_behind.finish_all(self.lock)

    def poll_writes(self) -> None:
        """Forget finished write-behinds so their buffers return to the pool (raising if one failed)."""
        self._forget_finished_writes()

    def drop_cache(self) -> None:
        """Make the cache agree with the disk after something replaced the bytes there (a checkpoint load):
        every group nobody uses is forgotten, and every group in use or pinned (partitions handed out are
        views of its slot, so it cannot be let go) is read again in place, so those views hold the new
        bytes too."""
        with self.lock:
            self.drain_writes()
            reread = []
            for g in self.groups:
                if g.ticket is not None:
                    self.store.wait(g.ticket)
                    g.ticket = None
                g.ghost, g.writes = False, []
                if g.users or g.pins:
                    if g.buffer is not None:
                        reread.append(g)
                    continue
                g.buffer = None
                if g.slot is not None:
                    self.slots.give(g.slot)
                    g.slot = None
            for g in reread:
                self.slots.before_change(g.slot)
            tickets = [
                self.store.read_span(self.params_file, g.offset, g.buffer, f"layer group {g.name} (reloaded)")
                for g in reread
            ]
            for t in tickets:
                self.store.wait(t)
