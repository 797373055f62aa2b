"""Gradients of the optimizer sub-groups: one fp32 buffer per sub-group, opened when its first gradient
arrives, written out under memory pressure and read back with the chunks that need it.

ZeRO-3 keeps every gradient partition of the model in one host buffer (4 bytes per parameter, outside any
budget). :class:`GradientPartitions` stands in for its ``ds_id -> gradient partition`` dict and hands out
views of :class:`SubGroupGradients`' buffers instead; under memory pressure a buffer is written to the
sub-group's gradient extent (the sub-groups the step reaches last go first) and read back, a chunk's slice
at a time, with that chunk. Resident sub-groups keep their gradient in host memory.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from aidaptiv_ds.swap.chunk_layout import FP32, Chunk, SubGroup

# Elements per row of partition_norm: long enough that a row's reduction in the gradient's dtype is cheap, short
# enough that its rounding stays far below what clipping could notice.
NORM_ROW = 256


def partition_norm(grad: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a gradient partition as a 0-dim fp64 tensor, for ZeRO-3's gradient clipping.

    DeepSpeed's ``_constant_buffered_norm2`` converts the whole partition to fp64 first: a fresh 8-byte copy
    of every gradient element each step (61 MiB for tiny's LM head), which on CPU costs more page faults
    than arithmetic (about 0.2 s of a 1.2 s step on tiny). Here each row of ``NORM_ROW`` elements is
    reduced in fp32 (torch's reduction) and the rows' squares are summed in fp64: the result differs from
    DeepSpeed's by less than 1e-7 relative (a row's fp32 sum; tests/unit/test_partition_norm.py), a
    clipping factor changed in its seventh digit."""
    flat = grad.reshape(-1)
    whole = flat.numel() // NORM_ROW * NORM_ROW
    square = torch.zeros((), dtype=torch.float64, device=flat.device)
    if whole:
        rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), 2, dim=1, dtype=torch.float32)
        square = square + rows.double().square().sum()
    if whole < flat.numel():
        square = square + flat[whole:].double().square().sum()
    return square.sqrt()


class SubGroupGradients:
    """The gradient buffers of this accumulation window, one per sub-group of ``sub_groups`` (shared with
    the optimizer swapper, which appends to it). Writes go into ``writes`` (a store.WriteBehind) of
    ``file``; ``lock`` is the optimizer swapper's. ``current_stream`` is the accelerator's (a callable
    returning the stream work is queued on now), or None where copies are synchronous (DeepSpeed's CPU
    accelerator): see :meth:`note_copies`."""

    def __init__(self, store, memory, file, sub_groups: List[SubGroup], writes, lock, current_stream=None):
        self.store = store
        self.memory = memory
        self.file = file
        self.sub_groups = sub_groups
        self.writes = writes
        self.lock = lock
        self.current_stream = current_stream
        self._copy_streams: Dict[int, set] = {}  # sub-group index -> streams that may copy to or from its buffer

    def open(self, sg: SubGroup) -> torch.Tensor:
        """The fp32 gradient buffer of ``sg`` for this accumulation window (ZeRO-3 copies or adds into it)."""
        with self.lock:
            if sg.grad is not None:
                return sg.grad
            sg.pins += 1
            try:
                buf = self.memory.take(sg.part, f"gradients of sub-group {sg.index}")
            finally:
                sg.pins -= 1
            grad = buf[: sg.numel * 4].view(FP32)
            if sg.grad_on_disk:
                # Written out under memory pressure (earlier in this backward, or in earlier micro-steps):
                # continue from those values.
                self.store.wait(
                    self.store.read_span(
                        self.file,
                        sg.grad_extent.offset,
                        buf[: sg.grad_extent.reserved],
                        f"gradients of sub-group {sg.index}",
                    )
                )
            else:
                grad.zero_()  # first gradient of this window
            sg.grad = grad
            return grad

    def open_bucket(self, sgs: List[SubGroup]) -> None:
        """Open the gradient buffers of ``sgs`` (the sub-groups one reduce bucket of ZeRO-3 is about to
        write into) as one contiguous block, before ZeRO-3 touches any of them.

        Why: ZeRO-3 holds a view of every gradient buffer a bucket touched until the whole bucket is
        partitioned, so those buffers cannot be freed before then; opened one by one, each between
        buffers that were written out and freed meanwhile, they cut the pool so that the bucket's largest
        buffer found no block big enough although the pool had room for it (a 29.3 MiB gradient against a
        27.4 MiB largest free block, tiny preset, 260 MiB budget). As one block, taken while nothing of
        the bucket is held yet, everything else in the way can still be written out, so the block fits
        whenever the bucket's gradients fit at all. A member already open elsewhere (from an earlier bucket
        or micro-step) joins the block only when the block does not fit beside it: it is written out and
        read back into the block, so no member of the bucket is left where it could cut the free space."""
        with self.lock:
            bucket = list({sg.index: sg for sg in sgs if not sg.resident}.values())
            todo = [sg for sg in bucket if sg.grad is None]
            if not todo:
                return
            for sg in bucket:
                sg.pins += 1
            try:
                buf = self.memory.try_take(sum(sg.part for sg in todo))
                if buf is None:
                    for sg in bucket:
                        if sg.grad is not None:
                            self._write_out(sg)
                    todo = bucket
                    names = ", ".join(str(sg.index) for sg in todo)
                    buf = self.memory.take(
                        sum(sg.part for sg in todo), f"gradients of sub-groups {names} (one reduce bucket, one block)"
                    )
                offset, reads = 0, []
                for sg in todo:
                    part = buf[offset : offset + sg.part]
                    offset += sg.part
                    if sg.grad_on_disk:
                        reads.append(
                            self.store.read_span(
                                self.file,
                                sg.grad_extent.offset,
                                part[: sg.grad_extent.reserved],
                                f"gradients of sub-group {sg.index}",
                            )
                        )
                    else:
                        part.zero_()
                    sg.grad = part[: sg.numel * 4].view(FP32)
                for t in reads:
                    self.store.wait(t)
            finally:
                for sg in bucket:
                    sg.pins -= 1

    def tensor(self, sg: SubGroup) -> Optional[torch.Tensor]:
        """This window's gradient of ``sg`` in host memory (read back if it was written out); None when no
        gradient arrived."""
        if sg.grad is not None:
            return sg.grad
        return self.open(sg) if sg.grad_on_disk else None

    def of_chunk(self, sg: SubGroup, c: Chunk) -> torch.Tensor:
        """The gradient of chunk ``c``: a slice of the sub-group's buffer in host memory, or the part of
        the chunk's buffer it was read into, or zeros when no gradient arrived this window."""
        if sg.grad is not None:
            return sg.grad[c.start : c.start + c.numel]
        if c.grad_view is not None:
            return c.grad_view
        if sg.grad_on_disk:  # written out after the chunk was loaded: read this chunk's slice now
            return self._read_chunk_slice(sg, c)
        return torch.zeros(c.numel, dtype=FP32)

    def _read_chunk_slice(self, sg: SubGroup, c: Chunk) -> torch.Tensor:
        glo, ghi, gshift = c.grad_cover()
        buf = self.memory.take(ghi - glo, f"gradients of optimizer sub-group {sg.index}")
        self.store.wait(
            self.store.read_span(
                self.file, sg.grad_extent.offset + glo, buf, f"gradients of optimizer sub-group {sg.index}"
            )
        )
        return buf[gshift : gshift + c.numel * 4].view(FP32)

    def reclaim(self) -> bool:
        """Write out the gradient buffer of the sub-group the step will reach last, and free it (a
        HostMemory reclaimer)."""
        with self.lock:
            candidates = [sg for sg in self.sub_groups if sg.grad is not None and sg.pins == 0 and not sg.resident]
            if not candidates:
                return False
            self._write_out(candidates[-1])
            return True

    def note_copies(self, sg: SubGroup) -> None:
        """ZeRO-3 has just looked up ``sg``'s buffer and is about to copy into it (or, at later micro-steps,
        out of it to add to it) on the current stream, without blocking: remember that stream."""
        if self.current_stream is not None:
            with self.lock:
                self._copy_streams.setdefault(sg.index, set()).add(self.current_stream())

    def _wait_for_copies(self, sg: SubGroup) -> None:
        # The copies ZeRO-3 queued on ``sg``'s (pinned) buffer must be done before the buffer is written out
        # and given back to the pool. Only the streams they were queued on are waited for (ZeRO-3's
        # reduce-and-partition stream in the backward), not the whole device, so the forward's and backward's
        # kernels on the compute stream run on.
        for stream in self._copy_streams.pop(sg.index, ()):
            stream.synchronize()

    def _write_out(self, sg: SubGroup) -> None:
        """Write the gradient buffer of ``sg`` to its extent (behind the caller) and let go of it."""
        self._wait_for_copies(sg)
        buf = sg.grad.view(torch.uint8)
        t = self.store.write_span(self.file, sg.grad_extent.offset, buf, f"gradients of sub-group {sg.index}")
        self.writes.add(t, buf, True)
        sg.grad = None
        sg.grad_on_disk = True

    def reset(self, sg: SubGroup) -> None:
        """The step consumed the sub-group's gradients: the next window starts from zero."""
        self._wait_for_copies(sg)  # long done by now (the backward's end waited for them): cheap
        sg.grad = None
        sg.grad_on_disk = False

    def held_bytes(self) -> int:
        return sum(sg.part for sg in self.sub_groups if sg.grad is not None)


class GradientPartitions:
    """Stands in for ZeRO-3's ``param ds_id -> gradient partition`` dict, backed by per-sub-group buffers.

    ZeRO-3 copies (first micro-step) or adds (later ones) each reduced gradient partition into the tensor
    this returns, then reads it back at the accumulation boundary for the norm. Buffers are opened on first
    use, so only sub-groups that are receiving gradients take host memory.
    """

    def __init__(self, gradients: SubGroupGradients, positions: Dict[int, tuple]):
        self.gradients = gradients
        self.positions = positions  # ds_id -> (SubGroup, offset, numel)

    def __getitem__(self, ds_id):
        sg, offset, numel = self.positions[ds_id]
        grad = self.gradients.open(sg)
        # Every copy ZeRO-3 makes to or from a gradient partition follows its look-up here, on the same stream.
        self.gradients.note_copies(sg)
        return grad.narrow(0, offset, numel)

    def __contains__(self, ds_id):
        return ds_id in self.positions

    def get(self, ds_id, default=None):
        return self[ds_id] if ds_id in self.positions else default

    def keys(self):
        return self.positions.keys()

    def __iter__(self):
        return iter(self.positions)

    def __len__(self):
        return len(self.positions)
