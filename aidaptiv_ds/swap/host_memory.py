"""Host memory under the budget: :class:`HostMemory` hands out 4 KiB-aligned buffers from the engine's pinned
pool, never more than the budget, asking registered reclaimers (write-behind completions, retained layer
groups) for memory before it gives up with :class:`HostBudgetError`; :class:`WriteBehind` keeps writes in
flight, :class:`SlotPool` reuses fixed-size slots."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from aidaptiv_ds.common.sizes import (  # the swappers import these two from here too
    ALIGN,
    align_up,
)
from aidaptiv_ds.engine.io import PinnedPool
from aidaptiv_ds.swap.store import SwapStore


class HostBudgetError(MemoryError):
    """The host memory budget cannot hold what a step needs, even after reclaiming."""


class HostMemory:
    """Aligned host buffers from one pinned pool, bounded by its capacity (the host budget).

    ``take`` never blocks on its own: when the pool is full it runs the reclaimers, most recently
    registered last, each of which frees something it owns (finishing a write-behind, dropping a
    retained group) and returns True if it did. Only when nothing is left to reclaim does it fail.
    """

    def __init__(self, pool: PinnedPool):
        self.pool = pool
        self._reclaimers: List[Tuple[str, Callable[[], bool], bool]] = []
        self._holders: List[Tuple[str, Callable[[], int]]] = []

    @property
    def capacity(self) -> int:
        return self.pool.stats()["capacity"]

    def add_reclaimer(self, name: str, fn: Callable[[], bool], cheap: bool = False) -> None:
        """``fn`` frees something and returns True if it did. A *cheap* reclaimer never waits for I/O
        (it forgets finished writes or drops clean cached copies), so even a non-blocking take may use it."""
        self._reclaimers.append((name, fn, cheap))

    def add_holder(self, name: str, fn: Callable[[], int]) -> None:
        """Something that holds pool memory and can say how much (for the exhaustion message)."""
        self._holders.append((name, fn))

    def _allocate(self, nbytes: int, large: bool) -> Optional[torch.Tensor]:
        # Large buffers (layer groups) from the low end, the rest from the high end: see PinnedPool. A full
        # pool is routine here, so no exception is raised for it (PinnedPool.try_allocate).
        buf = self.pool.try_allocate(align_up(nbytes), torch.uint8, from_top=not large)
        return None if buf is None else buf[:nbytes]

    def try_take(self, nbytes: int, large: bool = False) -> Optional[torch.Tensor]:
        """A buffer if one is free or can be freed without waiting for I/O; None otherwise. ``large``:
        a long-lived buffer of the largest kind (a layer group)."""
        buf = self._allocate(nbytes, large)
        while buf is None:
            if not any(fn() for _, fn, cheap in self._reclaimers if cheap):
                return None
            buf = self._allocate(nbytes, large)
        return buf

    def take(self, nbytes: int, what: str, large: bool = False) -> torch.Tensor:
        buf = self.try_take(nbytes, large)
        while buf is None:
            freed = False
            for _, fn, _ in self._reclaimers:
                if fn():
                    freed = True
                    buf = self._allocate(nbytes, large)
                    if buf is not None:
                        break
            if buf is None and not freed:
                # A reclaimer may have let memory go without being sure of it (a buffer other references
                # held until a write finished): look once more before giving up.
                buf = self._allocate(nbytes, large)
                if buf is not None:
                    break
                s = self.pool.stats()
                amounts = [(name, fn()) for name, fn in self._holders]
                # What no holder owns is buffers their owners let go while others still reference them
                # (gradient views in a DeepSpeed reduce bucket): freed when those references drop.
                amounts.append(("still referenced elsewhere", max(0, s["in_use"] - sum(a for _, a in amounts))))
                held = ", ".join(f"{name} {amount / 2**20:.1f} MiB" for name, amount in amounts)
                # Staging of activations in flight grows with the sequence: say which setting bounds it.
                activations = (
                    ", or aidaptiv.activations.read_ahead (or a shorter sequence)"
                    if any(name.startswith("activation") and amount for name, amount in amounts)
                    else ""
                )
                raise HostBudgetError(
                    f"host memory budget exhausted: {what} needs {nbytes / 2**20:.1f} MiB but "
                    f"{s['in_use'] / 2**20:.1f} of {s['capacity'] / 2**20:.1f} MiB are in use ({held}; largest "
                    f"free block {s['largest_free'] / 2**20:.1f} MiB) and nothing can be reclaimed: raise "
                    "aidaptiv.host_memory_budget, or lower aidaptiv.layer_group_size, prefetch_depth or "
                    f"optimizer_chunk_numel{activations}"
                )
        return buf

    def stats(self) -> dict:
        return self.pool.stats()


class WriteBehind:
    """Writes in flight whose source buffers must stay referenced until they complete.

    Each entry is (ticket, buffer, frees): ``frees`` says whether finishing the write gives memory back to
    the pool (a staging buffer) or not (a view of memory someone else owns). Callers hold their own lock
    around every method but ``finish_all``, which takes it only to detach the entries.
    """

    def __init__(self, store: "SwapStore"):
        self.store = store
        self._items: List[Tuple[Any, torch.Tensor, bool]] = []

    def add(self, ticket, buffer: torch.Tensor, frees: bool) -> None:
        self._items.append((ticket, buffer, frees))

    def held_bytes(self) -> int:
        """Pool memory that finishing these writes would give back."""
        return sum(b.numel() * b.element_size() for _, b, frees in self._items if frees)

    def forget_finished(self) -> bool:
        """Drop the writes that have completed (raising if one failed); True if any was dropped."""
        still = []
        for item in self._items:
            if item[0].done():
                self.store.wait(item[0])
            else:
                still.append(item)
        dropped = len(still) < len(self._items)
        self._items = still
        return dropped

    def finish_oldest(self, after_each: Optional[Callable[[], Any]] = None) -> bool:
        """Wait for writes, oldest first, until one whose completion frees memory; True if one did."""
        while self._items:
            ticket, _, frees = self._items.pop(0)
            self.store.wait(ticket)
            if after_each is not None:
                after_each()
            if frees:
                return True
        return False

    def finish_all(self, lock) -> None:
        """Wait for every write (outside ``lock``, so that other threads can go on meanwhile)."""
        with lock:
            items, self._items = self._items, []
        for ticket, _, _ in items:
            self.store.wait(ticket)


class SlotPool:
    """``count`` equal buffers of ``slot_bytes`` carved from the host budget once. Any free slot fits any
    user, so however users come and go the slots never fragment.

    ``fence`` (None on the CPU): on an accelerator, copies from a slot to the device run behind the host, so a
    slot's bytes may be changed (a read into it, an update written through) or the slot handed to another
    group only once those copies are done. ``device_reads_issued(slot)`` marks that copies from the slot may
    be queued (the fence records an event on the copying streams); ``before_change(slot)`` waits for them.
    :meth:`take` does so for every slot it hands out."""

    def __init__(self, memory: "HostMemory", count: int, slot_bytes: int):
        self.count = count
        self.slot_bytes = align_up(slot_bytes)
        self.region = memory.take(count * self.slot_bytes, f"{count} layer-group slots", large=True)
        self._free = list(range(count - 1, -1, -1))
        self.fence = None

    def take(self) -> Optional[int]:
        if not self._free:
            return None
        index = self._free.pop()
        self.before_change(index)
        return index

    def device_reads_issued(self, index: int) -> None:
        if self.fence is not None:
            self.fence.record(index)

    def before_change(self, index: int) -> None:
        if self.fence is not None:
            self.fence.wait(index)

    def give(self, index: int) -> None:
        self._free.append(index)

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        start = index * self.slot_bytes
        return self.region[start : start + nbytes]

    def free_count(self) -> int:
        return len(self._free)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A 4 KiB-aligned uint8 CPU tensor from the ordinary allocator (for one-off transfers that need
    no pinning, such as writing each parameter once while the model is being built).

    The device is named: while the model is built under ``deepspeed.zero.Init``, DeepSpeed's wrapper of
    ``torch.empty`` puts every tensor made without one on the accelerator, so on CUDA the buffers the
    parameter swapper hands out there were GPU tensors, which the engine refuses to read or write."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device="cpu")
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift : shift + nbytes]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's storage."""
    return t.reshape(-1).view(torch.uint8)


class CudaSlotFence:
    """Per slot, CUDA events recorded after the copies from it that the streams ``streams()`` returns may have
    queued; waited on the host before the slot changes. DeepSpeed's ZeRO-3 copies a fetched partition on its
    all-gather stream and releases the parameter after waiting on the default stream only, so the event is
    recorded on both (aidaptiv_ds.zero3 passes them)."""

    def __init__(self, streams):
        self._streams = streams
        self._events: dict = {}

    def record(self, slot: int) -> None:
        # The newest event on a stream covers all the work queued on it before: it replaces older ones.
        events = []
        for stream in self._streams():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        self._events[slot] = events

    def wait(self, slot: int) -> None:
        for event in self._events.pop(slot, ()):
            event.synchronize()
