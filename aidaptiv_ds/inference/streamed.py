"""A causal LM whose weights live in the swap space and are streamed through a few pinned slots, layer group by
layer group, while the model computes.

    weights = StreamedWeights(model, source, host_budget, nvme_path)   # lays the weights out once
    weights.attach()                                                   # hooks: model(...) now streams
    ...                                                                # generate as usual
    weights.close()

The model is built with empty parameters. Its parameters fall into *groups* (:mod:`.weight_groups`): each
layer of a decoder's layer list, and every other module with parameters of its own (embeddings, final norm, LM
head), run in the model's module order once per forward pass. :class:`StreamedWeights` is built in three steps,
one module each, each class the base of the next: the plan (:mod:`.weight_plan`: which groups stay resident and
which are streamed, through how many slots, encoded or not, within the host budget and, on CUDA, the GPU's), the
lay-out (:mod:`.weight_layout`: the resident groups in memory, the others written once into one swap file of the
swap space), and here the read ring, which brings the streamed groups in while the model computes.

The streamed layers go through a ring of equal slots taken from the pinned pool: a layer's forward pre-hook waits
for its read, binds its parameters to views of the slot, and issues reads of the next streamed layers into every
free slot (cyclic: the last layer's read-ahead is the first streamed layer of the next token), and its forward
hook gives the slot back. Two slots, so one layer computes while the next is read. On CPU a layer stored encoded
(``encode``; :mod:`aidaptiv_ds.inference.weight_codec`) is decoded by the pre-hook from its slot into the one
decode buffer (the engine's C++, at memory speed), and the slot is given back at once, so the next read starts
before the layer computes. An input embedding table read by rows has hooks of its own: its forward reads the rows
of its tokens (a few KiB a token) from the swap file into a small row buffer, directly rather than behind the
layers' read-ahead in the engine's queue.

On CUDA each slot has a twin on the GPU: a read slot is copied to its twin on a copy stream (an event orders the
compute after it), the pinned slot is reused only after that copy's event, and a twin only after the compute of
the layer it held (an event recorded by the forward hook). The layers the plan keeps in pinned host memory are
copied to their twin each pass without a disk read.

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

from aidaptiv_ds.common.sizes import ALIGN, align_up
from aidaptiv_ds.inference.sources import WeightSource
from aidaptiv_ds.inference.weight_groups import DeviceBudgetTooSmall, Group, HostBudgetTooSmall, Slot
from aidaptiv_ds.inference.weight_layout import LaidOutWeights
from aidaptiv_ds.inference.weight_plan import ENCODE_ALL, ENCODE_AUTO

log = logging.getLogger(__name__)


class StreamedWeights(LaidOutWeights):
    """The weights of ``model`` (built empty) from ``source``, resident or streamed as the budget allows.

    ``dtype`` converts floating-point weights when they are laid out (None keeps the source's).
    ``device_budget`` (CUDA only; bytes) bounds what stays on the GPU: the groups every step uses, the resident
    layers and the slots' GPU twins; the host budget then holds the slots and, beyond them, layers kept in
    pinned host memory and copied to the GPU each pass; the rest comes from the swap file.
    ``encode`` (CPU only): the dtypes whose tensors the streamed layers store encoded, losslessly (fewer bytes
    a token to read; ``ENCODE_AUTO``, the 2-byte floats, where decoding is cheap beside the quarter it saves).
    ``experts`` and ``experts_from``: how a mixture-of-experts model's routed experts are read (``routed``: as
    its routers choose them, through the expert cache, :mod:`aidaptiv_ds.inference.expert_cache`; ``whole``:
    with their layers), and from where (``auto``: the model's own files where they can be read in place, else
    the swap file; ``model``; ``swap``).
    ``stats`` counts what moved: ``bytes_read`` and ``reads`` (from the swap file and, for experts read in
    place, the model's files: everything), of them ``rows_bytes_read`` and ``rows_reads`` (embedding rows) and
    ``expert_bytes_read`` and ``expert_reads`` (routed experts; with ``expert_lookups`` and ``expert_hits``, the
    experts steps needed and found in the cache), ``wait_s`` (time the compute waited for a read),
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
        experts: str = "routed",
        experts_from: str = "auto",
    ):
        self._hooks: list = []
        self._row_fd: Optional[int] = None  # the swap file, opened by the first read of embedding rows
        super().__init__(
            model,
            source,
            host_budget,
            nvme_path,
            device=device,
            dtype=dtype,
            max_slots=max_slots,
            progress=progress,
            device_budget=device_budget,
            encode=encode,
            experts=experts,
            experts_from=experts_from,
        )

    # ------------------------------------------------------------------------------------------ embedding rows

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
        if self.expert_cache is not None:
            self.expert_cache.attach()
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
        super().close()
