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

from aidaptiv_ds.chunk_layout import FP32, Chunk, SubGroup


class SubGroupGradients:
    """The gradient buffers of this accumulation window, one per sub-group of ``sub_groups`` (shared with
    the optimizer swapper, which appends to it). Writes go into ``writes`` (a store.WriteBehind) of
    ``file``; ``lock`` is the optimizer swapper's."""

    def __init__(self, store, memory, file, sub_groups: List[SubGroup], writes, lock):
        self.store = store
        self.memory = memory
        self.file = file
        self.sub_groups = sub_groups
        self.writes = writes
        self.lock = lock

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
            grad = buf[:sg.numel * 4].view(FP32)
            if sg.grad_on_disk:
                # Written out under memory pressure (earlier in this backward, or in earlier micro-steps):
                # continue from those values.
                self.store.wait(self.store.read_span(
                    self.file, sg.grad_extent.offset, buf[:sg.grad_extent.reserved], f"gradients of sub-group {sg.index}"))
            else:
                grad.zero_()  # first gradient of this window
            sg.grad = grad
            return grad

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
            return sg.grad[c.start:c.start + c.numel]
        if c.grad_view is not None:
            return c.grad_view
        if sg.grad_on_disk:  # written out after the chunk was loaded: read this chunk's slice now
            return self._read_chunk_slice(sg, c)
        return torch.zeros(c.numel, dtype=FP32)

    def _read_chunk_slice(self, sg: SubGroup, c: Chunk) -> torch.Tensor:
        glo, ghi, gshift = c.grad_cover()
        buf = self.memory.take(ghi - glo, f"gradients of optimizer sub-group {sg.index}")
        self.store.wait(self.store.read_span(self.file, sg.grad_extent.offset + glo, buf,
                                             f"gradients of optimizer sub-group {sg.index}"))
        return buf[gshift:gshift + c.numel * 4].view(FP32)

    def reclaim(self) -> bool:
        """Write out the gradient buffer of the sub-group the step will reach last, and free it (a
        HostMemory reclaimer)."""
        with self.lock:
            candidates = [sg for sg in self.sub_groups if sg.grad is not None and sg.pins == 0 and not sg.resident]
            if not candidates:
                return False
            sg = candidates[-1]
            self._sync_device()
            buf = sg.grad.view(torch.uint8)
            t = self.store.write_span(self.file, sg.grad_extent.offset, buf, f"gradients of sub-group {sg.index}")
            self.writes.add(t, buf, True)
            sg.grad = None
            sg.grad_on_disk = True
            return True

    @staticmethod
    def reset(sg: SubGroup) -> None:
        """The step consumed the sub-group's gradients: the next window starts from zero."""
        sg.grad = None
        sg.grad_on_disk = False

    def held_bytes(self) -> int:
        return sum(sg.part for sg in self.sub_groups if sg.grad is not None)

    @staticmethod
    def _sync_device():
        # Gradient partitions reach host buffers through non-blocking device-to-host copies; they must
        # land before a buffer is written out.
        if torch.cuda.is_available():
            torch.cuda.synchronize()


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
        return self.gradients.open(sg).narrow(0, offset, numel)

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
