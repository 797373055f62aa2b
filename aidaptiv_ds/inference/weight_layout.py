"""The lay-out of a streamed model's weights (:mod:`aidaptiv_ds.inference.streamed`): each group put where its
plan (:mod:`.weight_plan`) says, once, before the first forward.

Resident groups are filled from the source and their parameters bound to them for good: on CPU in pinned memory,
on CUDA on the GPU, staged through unpinned memory that is freed at once (the GPU holds the group's only copy).
On CUDA the layers kept in host memory are filled into pinned buffers. The other layers are laid into one swap
file of the swap space, each layer one contiguous, 4 KiB aligned extent, so that bringing one in is one request
of the I/O engine; they are written through the slots in turn (one fills from the source while another is being
written), encoded where the plan chose codes (the decode buffer stages the layer's bytes; ``_decode``, which the
read ring calls, turns them back). A table read by rows is written through the row buffer and bound to a
placeholder of its shape between forwards. Routed experts (:mod:`.expert_units`) read in place need nothing laid
out: their model files are opened by the engine (O_DIRECT, read only where the file is); any other set of experts
is written into the swap file, one extent a set, its experts one after another. This module owns the pinned pool,
the engine, the swap file, the model files it opened and the buffers in the pool (the slots and their GPU twins,
the row and decode buffers, the expert cache's slots); ``close`` gives them back.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import torch

from aidaptiv_ds.common.sizes import align_up, format_size
from aidaptiv_ds.engine.disk import UnsuitableDisk, swap_folder_problem
from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.inference.expert_cache import ExpertCache
from aidaptiv_ds.inference.expert_units import ExpertSet
from aidaptiv_ds.inference.sources import WeightSource
from aidaptiv_ds.inference.weight_codec import decode_into, encode_into
from aidaptiv_ds.inference.weight_groups import Group, HostBudgetTooSmall, Slot, read_member
from aidaptiv_ds.inference.weight_plan import WeightPlan
from aidaptiv_ds.swap.space import SwapSpace


class LaidOutWeights(WeightPlan):
    """The weights of ``model`` laid out as their plan says, in memory and in the swap file under ``nvme_path``;
    the parameters are those of :class:`~aidaptiv_ds.inference.streamed.StreamedWeights`. ``stats`` starts here
    (``layout_s``, ``layout_bytes``); the read ring counts the rest."""

    def __init__(
        self,
        model: torch.nn.Module,
        source: WeightSource,
        host_budget: int,
        nvme_path: Optional[str],
        device: str = "cpu",
        dtype: Optional[torch.dtype] = None,
        max_slots: int = 2,
        progress=None,
        device_budget: Optional[int] = None,
        encode: Tuple[torch.dtype, ...] = (),
        experts: str = "routed",
        experts_from: str = "auto",
    ):
        super().__init__(
            model,
            source,
            host_budget,
            device=device,
            dtype=dtype,
            max_slots=max_slots,
            progress=progress,
            device_budget=device_budget,
            encode=encode,
            experts=experts,
            experts_from=experts_from,
        )
        self.stats = {
            "bytes_read": 0,
            "reads": 0,
            "rows_bytes_read": 0,
            "rows_reads": 0,
            "wait_s": 0.0,
            "decode_s": 0.0,
            "layout_s": 0.0,
            "layout_bytes": 0,
        }
        self.row_buffer: Optional[torch.Tensor] = None
        self.decode_buffer: Optional[torch.Tensor] = None
        self.pool = PinnedPool(self._pool_bytes())
        self.engine = IOEngine(pool=self.pool)
        self.space: Optional[SwapSpace] = None
        self.file = None
        self.slots: List[Slot] = []
        self.expert_cache: Optional[ExpertCache] = None
        self._model_files: Dict[str, object] = {}  # opened by the engine for experts read in place
        try:
            self._lay_out(nvme_path)
        except BaseException:
            self.close()
            raise

    def _fill(self, g: Group, out: torch.Tensor) -> None:
        """The group's bytes from the source into ``out`` (uint8, g.nbytes), converting dtypes where asked."""
        for m in g.members:
            if m.name:
                read_member(self.source, m, out[m.offset : m.offset + m.nbytes])

    def _fill_encoded(self, g: Group, out: torch.Tensor) -> None:
        """The group's encoded bytes into ``out`` (uint8, g.encoded_nbytes), through the decode buffer."""
        staged = self.decode_buffer
        self._fill(g, staged)
        for m in g.members:
            if not m.name:
                continue
            raw = staged[m.offset : m.offset + m.nbytes]
            if m.book is None:
                out[m.encoded_offset : m.encoded_offset + m.nbytes].copy_(raw)
            else:
                encode_into(raw, m.book, out[m.encoded_offset : m.encoded_offset + m.book.nbytes])

    def _decode(self, g: Group, encoded: torch.Tensor) -> None:
        """Group ``g``'s bytes into the decode buffer from its encoded bytes ``encoded``."""
        out = self.decode_buffer
        for m in g.members:
            if not m.name:
                continue
            if m.book is None:
                out[m.offset : m.offset + m.nbytes].copy_(encoded[m.encoded_offset : m.encoded_offset + m.nbytes])
            else:
                decode_into(
                    encoded[m.encoded_offset : m.encoded_offset + m.book.nbytes],
                    m.book,
                    out[m.offset : m.offset + m.nbytes],
                )

    def _lay_out(self, nvme_path: str) -> None:
        start = time.perf_counter()
        for g in self.groups:
            if g.resident and self.device.type == "cpu":
                g.buffer = self.pool.allocate(g.nbytes)
                self._fill(g, g.buffer)
            elif g.resident:  # staged through unpinned memory freed at once: the GPU holds the group's only copy
                staging = torch.empty(g.nbytes, dtype=torch.uint8)
                self._fill(g, staging)
                g.buffer = staging.to(self.device)
                del staging
            elif g.in_host:
                g.buffer = self.pool.allocate(g.nbytes)
                self._fill(g, g.buffer)
                continue
            else:
                continue
            g.bind(g.buffer)
        self.stats["layout_bytes"] = self.resident_bytes + self.in_host_bytes
        streamed = self.swap_groups
        self._open_model_files()
        swap_sets = [s for s in self.expert_sets if not s.in_place]
        if (streamed or self.row_groups or swap_sets) and not nvme_path:
            raise HostBudgetTooSmall(
                f"the weights ({format_size(self.source.nbytes)}) do not fit the host budget "
                f"{format_size(self.host_budget)}: give `nvme_path` DIR (a folder on the NVMe SSD) to stream "
                f"{format_size(self.streamed_bytes + self.by_rows_bytes + sum(s.nbytes for s in swap_sets))} of "
                f"them from, or a `host_budget` above {format_size(self.source.nbytes)}"
            )
        if streamed or self.row_groups or swap_sets:
            # The rule of every swap folder (it exists, on a disk that takes O_DIRECT): never made here.
            problem = swap_folder_problem(nvme_path)
            if problem:
                raise UnsuitableDisk(f"`nvme_path` {problem}")
            self.space = SwapSpace(nvme_path, rank=0)
            self.file = self.space.create_file("weights", self.engine)
        if self.row_groups:
            self.row_buffer = self.pool.allocate(self.row_buffer_bytes)
            for g in self.row_groups:
                self._lay_out_rows(g)
                self._bind_placeholder(g)
                self.stats["layout_bytes"] += g.nbytes
                self._progress(f"laid out {g.label} (read by rows)")
        if self.decode_bytes:
            self.decode_buffer = self.pool.allocate(self.decode_bytes)
        if self.slot_count:
            for _ in range(self.slot_count):
                slot = Slot(self.pool.allocate(self.slot_bytes))
                if self.device.type == "cuda":
                    slot.device = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                self.slots.append(slot)
            # Write through two slots: one fills from the source while the other is being written.
            pending = [None] * len(self.slots)
            for i, g in enumerate(streamed):
                k = i % len(self.slots)
                if pending[k] is not None:
                    pending[k].wait()
                g.extent = self.file.allocate(g.read_nbytes)
                buf = self.slots[k].host[: g.read_nbytes]
                if g.encoded_nbytes:
                    self._fill_encoded(g, buf)
                else:
                    self._fill(g, buf)
                pending[k] = self.engine.write_async(buf, self.file.handle, g.extent.offset)
                self.stats["layout_bytes"] += g.nbytes
                self._progress(f"laid out {g.label} ({i + 1}/{len(streamed)})")
            for p in pending:
                if p is not None:
                    p.wait()
            # Until a streamed group is first read its parameters are views of a slot or of the decode buffer
            # (never used: the hooks bind the right bytes first), so model.device and dtype read right before the
            # first forward.
            for g in self.streamed_groups:
                if g.encoded_nbytes:
                    g.bind(self.decode_buffer)
                else:
                    g.bind(self.slots[0].device if self.slots[0].device is not None else self.slots[0].host)
        if self.expert_sets:
            pool = self.pool.allocate(self.expert_slots * self.expert_slot_bytes)
            for s in swap_sets:
                self._lay_out_experts(s, pool)
            files: Dict[Optional[str], object] = dict(self._model_files)
            sizes = {path: os.path.getsize(path) for path in files}
            # The swap file, when a set is read from it: its extents are whole units, never past its end.
            files[None], sizes[None] = (self.file.handle if self.file is not None else None), 1 << 62
            self.expert_cache = ExpertCache(
                pool, self.expert_slot_bytes, self.expert_sets, self.engine, files, sizes, self.stats
            )
        for g in self.groups:  # tied parameters: the very tensor of their first owner (both groups resident)
            for m in g.members:
                if m.tied_to is not None:
                    module, attr = m.tied_to
                    m.module._parameters[m.attr] = module._parameters[attr]
        self.stats["layout_s"] = time.perf_counter() - start

    def _open_model_files(self) -> None:
        """Open the model files the experts read in place come from; a set whose file the engine cannot open
        (another user's, a filesystem without O_DIRECT) is read from the swap file instead."""
        for s in self.expert_sets:
            if not s.in_place:
                continue
            paths = {path for reads in s.reads_in_place for path, _, _, _ in reads}
            try:
                for path in sorted(paths - set(self._model_files)):
                    # Resolved: a hub cache's snapshot holds links, which the engine does not follow.
                    self._model_files[path] = self.engine.open(os.path.realpath(path))
            except OSError as e:
                if self.experts_from == "model":
                    raise
                self.experts_note = f"experts of {s.label} and after read from the swap file: {e}"
                for later in self.expert_sets[s.index :]:
                    later.use_swap()
                return

    def _lay_out_experts(self, s: ExpertSet, pool: torch.Tensor) -> None:
        """Write set ``s``'s experts into one extent of the swap file, one unit each, through the expert cache's
        slots (empty until the first step)."""
        s.extent = self.file.allocate(s.num_experts * s.unit_bytes)
        per_turn = max(1, pool.numel() // s.unit_bytes)
        for first in range(0, s.num_experts, per_turn):
            pending = []
            for k, e in enumerate(range(first, min(s.num_experts, first + per_turn))):
                unit = pool[k * s.unit_bytes : (k + 1) * s.unit_bytes]
                unit.zero_()
                for p in s.params:
                    self._fill_expert_param(p, e, unit[p.offset : p.offset + p.nbytes])
                pending.append(self.engine.write_async(unit, self.file.handle, s.extent.offset + e * s.unit_bytes))
            for w in pending:
                w.wait()
        self.stats["layout_bytes"] += s.nbytes
        self._progress(f"laid out the experts of {s.label} ({s.index + 1}/{len(self.expert_sets)})")

    def _fill_expert_param(self, p, expert: int, out: torch.Tensor) -> None:
        """Expert ``expert``'s slice of parameter ``p`` from the source into ``out``, converted where asked."""
        entry = self.source.tensors[p.name]
        count = p.nbytes // p.dtype.itemsize
        if entry.dtype == p.dtype:
            self.source.read_range_into(p.name, expert * p.nbytes, out)
            return
        raw = torch.empty(count * entry.dtype.itemsize, dtype=torch.uint8)
        self.source.read_range_into(p.name, expert * raw.numel(), raw)
        out.view(p.dtype).copy_(raw.view(entry.dtype))

    def _lay_out_rows(self, g: Group) -> None:
        """Write table ``g`` into its extent through the row buffer, a buffer's worth at a time."""
        m = g.members[0]
        entry = self.source.tensors[m.name]
        assert m.offset == 0, "a table read by rows is its group's one tensor"
        g.extent = self.file.allocate(g.nbytes)
        buf = self.row_buffer
        chunk = buf.numel()  # a multiple of 4 KiB, so every chunk but the last is whole elements and pages
        src_item, dst_item = entry.dtype.itemsize, m.dtype.itemsize
        for b0 in range(0, m.nbytes, chunk):
            b1 = min(m.nbytes, b0 + chunk)
            dst = buf[: b1 - b0]
            if entry.dtype == m.dtype:
                self.source.read_range_into(m.name, b0, dst)
            else:
                tmp = torch.empty((b1 - b0) // dst_item * src_item, dtype=torch.uint8)
                self.source.read_range_into(m.name, b0 // dst_item * src_item, tmp)
                dst.view(m.dtype).copy_(tmp.view(entry.dtype))
            n = align_up(b1 - b0)
            buf[b1 - b0 : n].zero_()
            self.engine.write(buf[:n], self.file.handle, g.extent.offset + b0)

    def _bind_placeholder(self, g: Group) -> None:
        """Between forwards a table read by rows is one value seen at every position: its parameter keeps the
        table's shape, dtype and device (``model.device`` and ``model.dtype`` read them) without its bytes."""
        m = g.members[0]
        t = torch.zeros(1, dtype=m.dtype, device=self.device).expand(m.shape)
        m.module._parameters[m.attr] = torch.nn.Parameter(t, requires_grad=False)

    def close(self) -> None:
        """Wait for reads in flight, close the swap space (its file is removed) and the engine."""
        for s in self.slots:
            if s.request is not None:
                try:
                    s.request.wait()
                except OSError:
                    pass
                s.request = None
        if self.expert_cache is not None:
            self.expert_cache.detach()
            self.expert_cache = None
        for f in self._model_files.values():
            f.close()
        self._model_files = {}
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.space is not None:
            self.space.close()
            self.space = None
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None
