"""Parameter partitions on disk and their views in host memory.

- :class:`ParamRecord`: one partition, its extent in the parameter swap file and the layer group that
  holds it;
- :class:`LayerGroup`: consecutive partitions, contiguous on disk, read into one buffer of which every
  partition is a view; it also carries the bookkeeping (users, pins, writes in flight, slot, ghost) of
  :mod:`aidaptiv_ds.swap.layer_group_cache`, which alone changes it;
- :func:`piece_span` and :class:`MasterRun`: elements of partitions (pieces) as byte ranges on disk, and a
  run of adjacent pieces in one host buffer, which the optimizer step updates in place.

Records do no I/O and know nothing of DeepSpeed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from aidaptiv_ds.common.sizes import dtype_bytes
from aidaptiv_ds.swap.space import Extent
from aidaptiv_ds.swap.store import Ticket


@dataclass(eq=False)
class ParamRecord:
    """One parameter partition: where it lives on disk and the layer group that holds it."""

    ds_id: int
    numel: int
    dtype: torch.dtype
    extent: Extent
    param: "weakref.ref"
    group: Optional["LayerGroup"] = None
    published: bool = False  # a view of it is handed out (see LayerGroupCache.publish)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(eq=False)
class LayerGroup:
    """Consecutive parameter partitions read and cached together."""

    index: int
    name: str
    records: List[ParamRecord]
    offset: int = 0  # span on disk
    nbytes: int = 0
    buffer: Optional[torch.Tensor] = None
    ticket: Optional[Ticket] = None
    users: int = 0  # partitions currently published
    last_used: int = 0
    pins: int = 0  # > 0 while a swap-in, the prefetch window or an update needs it: not to be evicted
    writes: list = field(default_factory=list)  # tickets of write-throughs from this buffer
    slot: Optional[int] = None  # index of the slot holding the buffer (or the ghost)
    # Evicted while a write-through from its slot is in flight: the slot cannot be reused before that
    # write completes, and it holds exactly what the disk will hold, so a read of the group in that window
    # takes the slot back instead of waiting for the write and reading the same bytes again.
    ghost: bool = False
    # Retained: used by the forward, not yet by the backward; holds one of ``pins`` meanwhile.
    held: bool = False

    def view(self, rec: ParamRecord) -> torch.Tensor:
        start = rec.extent.offset - self.offset
        return self.buffer[start : start + rec.nbytes].view(rec.dtype)


def piece_span(rec: ParamRecord, start: int, numel: int) -> Tuple[int, int]:
    """Bytes [lo, hi) on disk of elements [start, start+numel) of a partition: ``start`` is at 4 KiB of the
    partition's bytes, and a piece that ends the partition runs to the end of its extent."""
    es = rec.nbytes // rec.numel
    lo = rec.extent.offset + start * es
    hi = rec.extent.end if start + numel == rec.numel else lo + numel * es
    return lo, hi


@dataclass(eq=False)
class MasterRun:
    """Consecutive pieces of partitions on disk (one layer group), in one host buffer, to be updated in
    place and written back (see ``LayerGroupCache.load_run`` and ``LayerGroupCache.write_pieces``)."""

    lo: int
    hi: int
    group: Optional[LayerGroup]  # set when the group is cached: the buffer is a view of it
    buffer: Optional[torch.Tensor] = None
    ticket: Optional[Ticket] = None
    pinned: bool = False
    # The layer group of a run staged outside the cache (no slot could be had): a copy of it cached before the
    # run is written back must get the updated bytes too.
    home: Optional[LayerGroup] = None

    @staticmethod
    def plan(run) -> "MasterRun":
        lo = piece_span(run[0][0], run[0][1], run[0][2])[0]
        hi = piece_span(run[-1][0], run[-1][1], run[-1][2])[1]
        g = run[0][0].group
        cached = g is not None and g.buffer is not None
        return MasterRun(lo, hi, g if cached else None)

    def view(self, rec: ParamRecord, start: int, numel: int) -> torch.Tensor:
        es = rec.nbytes // rec.numel
        a = rec.extent.offset + start * es - self.lo
        return self.buffer[a : a + numel * es].view(rec.dtype)
