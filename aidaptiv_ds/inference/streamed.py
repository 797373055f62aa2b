"""A causal LM whose weights live in the swap space and are streamed through a few pinned slots, layer group by
layer group, while the model computes.

    weights = StreamedWeights(model, source, host_budget, nvme_path)   # lays the weights out once
    weights.attach()                                                   # hooks: model(...) now streams
    ...                                                                # generate as usual
    weights.close()

The model is built with empty parameters. Its parameters fall into *groups* (:mod:`.weight_groups`): each
layer of a decoder's layer list, and every other module with parameters of its own (embeddings, final norm, LM
head), run in the model's module order once per forward pass.

Which groups stay resident (on CPU; CUDA's tiers are below): all of them when they fit the host budget. Otherwise
the groups outside the layer list (used at every step) and as many layers as fit stay resident, and the other
layers are laid into one swap file of the swap space, each layer one contiguous, 4 KiB aligned extent, so that
bringing one in is one request of the I/O engine. The exception is an input embedding table not tied to the head: a
step needs only the rows of its tokens, so the table is laid into the swap file too and its forward reads those
rows (a few KiB a token) into a small row buffer, directly rather than behind the layers' read-ahead in the
engine's queue; the budget it would have held keeps layers resident instead (tinyllama's 262 MB table is a layer
and a half, read every step otherwise). Those layers are streamed through a ring of equal slots taken from the same
pinned pool: a layer's forward pre-hook waits for its read, binds its parameters to views of the slot, and issues
reads of the next streamed layers into every free slot (cyclic: the last layer's read-ahead is the first streamed
layer of the next token), and its forward hook gives the slot back. Two slots, so one layer computes while the next
is read; the rest of the budget holds resident layers.

On CPU the streamed layers can be stored encoded (``encode``; :mod:`aidaptiv_ds.inference.weight_codec`: each
floating-point element's top byte as a 4-bit code, lossless): bf16 layers are read in three quarters of their
bytes, fp32 layers in seven eighths. The slots then hold encoded layers, and one more buffer of a layer's size
holds the decoded layer its forward runs on: the pre-hook decodes the slot into it (the engine's C++, at memory
speed) and gives the slot back at once, so the next read starts before the layer computes. Choosing the codes
takes one pass over the layers' weights before the plan (the slot size is the largest encoded layer).

On CUDA each slot has a twin on the GPU: a read slot is copied to its twin on a copy stream (an event orders the
compute after it), the pinned slot is reused only after that copy's event, and a twin only after the compute of
the layer it held (an event recorded by the forward hook). There are two budgets: the GPU budget holds the
groups every step uses, the twins and as many layers as fit (resident on the GPU, staged through unpinned memory
that is freed at once); the host budget holds the pinned slots and, with what is left, layers kept in pinned
host memory, which the ring copies to their twin each pass without a disk read; only the rest is read from the
swap file.

Why not the training cache (:class:`aidaptiv_ds.swap.layer_group_cache.LayerGroupCache`): its bookkeeping is for
parameter partitions that the optimizer writes back; generation only reads, in one fixed cyclic order, so a
ring of slots is all it needs. The engine, the swap space (its lock, its checked allocation that reports a full
disk when the file grows) and the pinned pool are the training path's own.
"""

from __future__ import annotations

# The errors its constructor raises and the dtypes ``encode`` takes are this module's too: generate and the
# tests import them from here.
__all__ = ["StreamedWeights", "HostBudgetTooSmall", "DeviceBudgetTooSmall", "ENCODE_AUTO", "ENCODE_ALL"]

import errno
import logging
import os
import time
from typing import List, Optional, Tuple

import torch

from aidaptiv_ds.common.sizes import ALIGN, align_up, format_size
from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.inference.sources import WeightSource
from aidaptiv_ds.inference.weight_codec import decode_into, encode_into
from aidaptiv_ds.inference.weight_groups import DeviceBudgetTooSmall, Group, HostBudgetTooSmall, Slot, read_member
from aidaptiv_ds.inference.weight_plan import ENCODE_ALL, ENCODE_AUTO, WeightPlan
from aidaptiv_ds.swap.space import SwapSpace

log = logging.getLogger(__name__)


class StreamedWeights(WeightPlan):
    """The weights of ``model`` (built empty) from ``source``, resident or streamed as the budget allows.

    ``dtype`` converts floating-point weights when they are laid out (None keeps the source's).
    ``device_budget`` (CUDA only; bytes) bounds what stays on the GPU: the groups every step uses, the resident
    layers and the slots' GPU twins; the host budget then holds the slots and, beyond them, layers kept in
    pinned host memory and copied to the GPU each pass; the rest comes from the swap file.
    ``encode`` (CPU only): the dtypes whose tensors the streamed layers store encoded, losslessly (fewer bytes
    a token to read; ``ENCODE_AUTO``, the 2-byte floats, where decoding is cheap beside the quarter it saves).
    ``stats`` counts what moved: ``bytes_read`` and ``reads`` (from the swap file, everything), of them
    ``rows_bytes_read`` and ``rows_reads`` (embedding rows), ``wait_s`` (time the compute waited for a read),
    ``decode_s`` (time spent decoding encoded layers), ``layout_s`` and ``layout_bytes``."""

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
    ):
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
        self._hooks: list = []
        self.row_buffer: Optional[torch.Tensor] = None
        self.decode_buffer: Optional[torch.Tensor] = None
        self._row_fd: Optional[int] = None
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
        )
        self.pool = PinnedPool(self._pool_bytes())
        self.engine = IOEngine(pool=self.pool)
        self.space: Optional[SwapSpace] = None
        self.file = None
        self.slots: List[Slot] = []
        try:
            self._lay_out(nvme_path)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ lay-out

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
        if (streamed or self.row_groups) and not nvme_path:
            raise HostBudgetTooSmall(
                f"the weights ({format_size(self.source.nbytes)}) do not fit the host budget "
                f"{format_size(self.host_budget)}: give `nvme_path` DIR (a folder on the NVMe SSD) to stream "
                f"{format_size(self.streamed_bytes + self.by_rows_bytes)} of them from, or a `host_budget` above "
                f"{format_size(sum(g.nbytes for g in self.groups))}"
            )
        if streamed or self.row_groups:
            os.makedirs(nvme_path, exist_ok=True)
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
        for g in self.groups:  # tied parameters: the very tensor of their first owner (both groups resident)
            for m in g.members:
                if m.tied_to is not None:
                    module, attr = m.tied_to
                    m.module._parameters[m.attr] = module._parameters[attr]
        self.stats["layout_s"] = time.perf_counter() - start

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

    def _read_rows(self, g: Group, ids: List[int]) -> torch.Tensor:
        """Rows ``ids`` (sorted, distinct) of table ``g`` from the swap file, as a [len(ids), width] tensor.

        Consecutive ids are one run of bytes; each run is read with the 4 KiB pages around it, runs whose pages
        touch share one read, and the reads fill the row buffer before its rows are copied out (a long prompt's
        rows take several buffer-fulls)."""
        m = g.members[0]
        row = g.row_bytes
        out = torch.empty((len(ids), m.shape[1]), dtype=m.dtype)
        out_bytes = out.view(-1).view(torch.uint8)
        buf = self.row_buffer
        cap = buf.numel()
        most = max(1, (cap - 2 * ALIGN) // row)  # rows of one run one read can hold
        spans: list = []  # [position in the buffer, first byte, end byte] of each read
        copies: list = []  # (first output row, first byte, rows, span index)

        def flush() -> None:
            if not spans:
                return
            t0 = time.perf_counter()
            for p, a0, a1 in spans:
                self._pread_rows(p, a1 - a0, g.extent.offset + a0)
            self.stats["wait_s"] += time.perf_counter() - t0
            nbytes = sum(a1 - a0 for _, a0, a1 in spans)
            self.stats["reads"] += len(spans)
            self.stats["rows_reads"] += len(spans)
            self.stats["bytes_read"] += nbytes
            self.stats["rows_bytes_read"] += nbytes
            for k, start, count, j in copies:
                p, a0, _ = spans[j]
                at = p + start - a0
                out_bytes[k * row : (k + count) * row].copy_(buf[at : at + count * row])
            spans.clear()
            copies.clear()

        i, n = 0, len(ids)
        while i < n:
            first, count = ids[i], 1
            while i + count < n and ids[i + count] == first + count and count < most:
                count += 1
            start = first * row
            a0, a1 = start // ALIGN * ALIGN, align_up(start + count * row)
            last = spans[-1] if spans else None
            if last is not None and a0 <= last[2] and last[0] + max(a1, last[2]) - last[1] <= cap:
                last[2] = max(a1, last[2])  # its pages touch the previous read's: one read
            else:
                used = last[0] + last[2] - last[1] if last is not None else 0
                if used + a1 - a0 > cap:
                    flush()
                    used = 0
                spans.append([used, a0, a1])
            copies.append((i, start, count, len(spans) - 1))
            i += count
        flush()
        return out

    def _pread_rows(self, at: int, nbytes: int, offset: int) -> None:
        """Read ``nbytes`` of the swap file at ``offset`` into the row buffer at ``at``, now.

        Not through the engine: its queue is first in, first out, and at the start of a step it holds the
        read-ahead of the next streamed layers (hundreds of MB), which a lookup of a few KiB would wait behind,
        with the disk idle while the resident layers compute after it. O_DIRECT where the file system has it, so
        the page cache holds nothing of the table."""
        if self._row_fd is None:
            try:
                self._row_fd = os.open(self.file.path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._row_fd = os.open(self.file.path, os.O_RDONLY | os.O_CLOEXEC)
            self._row_view = memoryview(self.row_buffer.numpy())
        done = 0
        while done < nbytes:
            try:
                got = os.preadv(self._row_fd, [self._row_view[at + done : at + nbytes]], offset + done)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"reading embedding rows from swap file {self.file.path} at byte {offset + done} failed: "
                    f"{os.strerror(e.errno)}; check the disk (dmesg) and run again",
                    self.file.path,
                ) from None
            if got == 0:
                raise OSError(
                    errno.EIO,
                    f"swap file {self.file.path} ends at byte {offset + done}, inside the embedding table: it was "
                    "truncated while this process ran; run again",
                    self.file.path,
                )
            done += got

    # ------------------------------------------------------------------------------------------ streaming

    def attach(self) -> None:
        """Register the hooks that stream the non-resident groups (nothing to do when all are resident)."""
        if self._hooks:
            return
        for g in self.row_groups:
            self._hooks.append(g.module.register_forward_pre_hook(self._make_rows_pre_hook(g), with_kwargs=True))
            self._hooks.append(g.module.register_forward_hook(self._make_rows_post_hook(g), always_call=True))
        if not self.slots:
            return
        self._order = self.streamed_groups
        self._position = {g.index: i for i, g in enumerate(self._order)}
        self._next_to_issue = 0  # index into _order of the next read to issue
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
        for g in self._order:
            self._hooks.append(g.module.register_forward_pre_hook(self._make_pre_hook(g)))
            self._hooks.append(g.module.register_forward_hook(self._make_post_hook(g)))
        self._issue_reads()

    def _slot_of(self, g: Group) -> Optional[Slot]:
        for s in self.slots:
            if s.group is g:
                return s
        return None

    def _issue_reads(self) -> None:
        """Issue reads of the next groups in cyclic order into every free slot."""
        for s in self.slots:
            if s.group is not None:
                continue
            g = self._order[self._next_to_issue]
            if self._slot_of(g) is not None:
                return  # every streamed group is already in a slot
            s.group, s.ready = g, False
            if g.in_host:  # no read: the pre-hook copies its pinned bytes to the twin
                s.request = None
            else:
                if s.copied is not None:  # CUDA: the host bytes may still be on their way to the twin
                    s.copied.synchronize()
                    s.copied = None
                s.request = self.engine.read_async(s.host[: g.read_nbytes], self.file.handle, g.extent.offset)
                self.stats["reads"] += 1
                self.stats["bytes_read"] += g.read_nbytes
            self._next_to_issue = (self._next_to_issue + 1) % len(self._order)

    def _make_rows_pre_hook(self, g: Group):
        m = g.members[0]
        vocab = m.shape[0]

        def pre_hook(module, args, kwargs):
            ids = args[0] if args else kwargs["input"]
            flat = ids.reshape(-1).cpu()
            rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
            if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= vocab):
                bad = int(rows[0]) if int(rows[0]) < 0 else int(rows[-1])
                raise IndexError(f"token id {bad} is outside {g.label}'s table of {vocab} rows")
            table = self._read_rows(g, rows.tolist())
            if self.device.type != "cpu":
                table, inverse = table.to(self.device), inverse.to(self.device)
            m.module._parameters[m.attr] = torch.nn.Parameter(table, requires_grad=False)
            # The rows are renumbered 0..n-1, so a padding row's number may be past the small table; it only
            # matters to gradients, and generation has none.
            module.padding_idx = None
            inverse = inverse.view(ids.shape)
            if args:
                return (inverse, *args[1:]), kwargs
            return args, dict(kwargs, input=inverse)

        return pre_hook

    def _make_rows_post_hook(self, g: Group):
        padding_idx = g.module.padding_idx

        def post_hook(module, args, output):
            module.padding_idx = padding_idx
            self._bind_placeholder(g)
            return None

        return post_hook

    def _make_pre_hook(self, g: Group):
        def pre_hook(module, args):
            s = self._slot_of(g)
            if s is None:  # out of the cyclic order (a forward that skipped layers): read it now
                self._next_to_issue = self._position[g.index]
                self._issue_reads()
                s = self._slot_of(g)
                if s is None:
                    raise RuntimeError(f"no free slot to read layer group {g.label} into")
            if not s.ready:
                t0 = time.perf_counter()
                if s.request is not None:
                    s.request.wait()
                    s.request = None
                if s.device is not None:
                    source = g.buffer if g.in_host else s.host
                    with torch.cuda.stream(self._copy_stream):
                        if s.computed is not None:
                            self._copy_stream.wait_event(s.computed)
                        s.device[: g.nbytes].copy_(source[: g.nbytes], non_blocking=True)
                        s.copied = torch.cuda.Event()
                        s.copied.record(self._copy_stream)
                    torch.cuda.current_stream(self.device).wait_event(s.copied)
                self.stats["wait_s"] += time.perf_counter() - t0
                s.ready = True
            if g.encoded_nbytes:
                # Decoded into the one decode buffer (the previous layer has run): the slot is free at once, and
                # its next read starts while this layer computes.
                t0 = time.perf_counter()
                self._decode(g, s.host)
                self.stats["decode_s"] += time.perf_counter() - t0
                s.group, s.ready = None, False
                self._issue_reads()
                g.bind(self.decode_buffer)
                return None
            g.bind(s.device if s.device is not None else s.host)
            return None

        return pre_hook

    def _make_post_hook(self, g: Group):
        def post_hook(module, args, output):
            s = self._slot_of(g)
            if s is not None:
                if s.device is not None:
                    s.computed = torch.cuda.Event()
                    s.computed.record(torch.cuda.current_stream(self.device))
                s.group, s.ready = None, False
            self._issue_reads()
            return None

        return post_hook

    def close(self) -> None:
        """Remove the hooks, wait for reads in flight, close the swap space (its file is removed)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._row_fd is not None:
            os.close(self._row_fd)
            self._row_fd = None
        for s in self.slots:
            if s.request is not None:
                try:
                    s.request.wait()
                except OSError:
                    pass
                s.request = None
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.space is not None:
            self.space.close()
            self.space = None
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None
