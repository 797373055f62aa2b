"""Where an optimizer sub-group's state lives: chunks, their images in the optimizer swap file, gradients.

ZeRO-3 updates its optimizer one *sub-group* at a time: a flat fp32 partition of a run of parameters. We
cut each sub-group into *chunks* of at most ``chunk_numel`` elements (:func:`cut_into_chunks`); a chunk's
*image* is one read and one write, made of ``parts`` fp32 vectors of the chunk, each padded to 4 KiB::

    separate master (bf16/fp16 model):  [ fp32 master | exp_avg | exp_avg_sq ]   (PARTS parts)
    master is the parameter (fp32):     [ exp_avg | exp_avg_sq ]                 (STATE_SLOTS parts)

The images of a sub-group's chunks are contiguous (its *region*), followed in the file by its fp32
gradient extent (:func:`lay_out_sub_group`). Chunk boundaries inside a parameter fall at 4 KiB of that
parameter's bytes, so every piece of a parameter written back is O_DIRECT-aligned.

The records also carry what the streamed step and the gradient buffers track about each chunk and
sub-group (buffers, tickets, state keys, pins); this module only lays them out and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch

from aidaptiv_ds.common.sizes import ALIGN, align_up, dtype_bytes

if TYPE_CHECKING:
    from aidaptiv_ds.swap.space import Extent
    from aidaptiv_ds.swap.store import Ticket

FP32 = torch.float32
FP32_BYTES = 4
# Full-size state tensors per parameter the layout has room for (Adam: exp_avg, exp_avg_sq).
STATE_SLOTS = 2
PARTS = 1 + STATE_SLOTS  # image parts per chunk when the master is kept separately


def image_parts(master_is_parameter: bool) -> int:
    """Parts of a chunk's image: the state slots, plus the fp32 master unless the parameter is the master."""
    return STATE_SLOTS if master_is_parameter else PARTS


@dataclass(eq=False)
class Piece:
    """Part of one parameter partition covered by a chunk: elements [start, start+numel) of ``record``."""

    record: object  # partition_layout.ParamRecord (numel, dtype, extent)
    start: int
    numel: int
    flat: int  # offset of the piece in the chunk (elements)


@dataclass(eq=False)
class Chunk:
    start: int  # first element within the sub-group
    numel: int
    offset: int  # file offset of its image
    pieces: List[Piece]
    parts: int  # image parts: master (unless the parameter is the master) and state slots
    buffer: Optional[torch.Tensor] = None  # uint8 image (+ the gradient slice, when read with it)
    read: Optional["Ticket"] = None
    grad_view: Optional[torch.Tensor] = None  # this chunk's gradient, read from disk with the image
    runs: Optional[list] = None  # fp32 model: MasterRuns holding the pieces' parameters

    @property
    def part(self) -> int:
        """Bytes of one part of the image: an fp32 vector of the chunk, padded to 4 KiB."""
        return align_up(self.numel * FP32_BYTES)

    @property
    def image_bytes(self) -> int:
        return self.parts * self.part

    @property
    def state_start(self) -> int:
        """Byte offset in the image of the first state slot (after the master, when there is one)."""
        return (self.parts - STATE_SLOTS) * self.part

    def slot(self, k: int) -> torch.Tensor:
        """Part ``k`` of the image in host memory, as fp32."""
        return self.buffer[k * self.part : k * self.part + self.numel * FP32_BYTES].view(FP32)

    def state_slot(self, j: int) -> torch.Tensor:
        """State tensor ``j`` (0: exp_avg, 1: exp_avg_sq for Adam) of the chunk, as fp32."""
        return self.slot(j + self.parts - STATE_SLOTS)

    def grad_cover(self) -> Tuple[int, int, int]:
        """Aligned byte range [lo, hi) of the sub-group's gradient extent that holds this chunk's gradient,
        and the chunk's offset in it (O_DIRECT reads whole 4 KiB blocks)."""
        lo = (self.start * FP32_BYTES) // ALIGN * ALIGN
        return lo, align_up((self.start + self.numel) * FP32_BYTES), self.start * FP32_BYTES - lo


@dataclass(eq=False)
class SubGroup:
    index: int
    numel: int
    chunks: List[Chunk]
    members: List[tuple]  # (record, flat offset, numel)
    region: "Extent"  # all chunk images, contiguous
    grad_extent: "Extent"
    resident: bool = False
    image: Optional[torch.Tensor] = None  # resident: the region in host memory
    state_keys: List[str] = field(default_factory=list)
    state_valid: bool = False  # slots hold real values (else they are zeros)
    scalars: Dict[str, object] = field(default_factory=dict)  # e.g. Adam's step count
    # gradients of the current accumulation window
    grad: Optional[torch.Tensor] = None  # fp32 [numel] in host memory
    grad_on_disk: bool = False  # the gradient extent holds this window's values (memory, when
    # present, is newer)
    pins: int = 0  # > 0 while its gradients must stay where they are
    whole: Optional[torch.Tensor] = None  # whole-sub-group copy for DeepSpeed's inspection APIs

    @property
    def part(self) -> int:
        """Bytes of one fp32 vector of the whole sub-group, padded to 4 KiB (its gradient buffer)."""
        return align_up(self.numel * FP32_BYTES)

    def adopt_image(self, image: torch.Tensor) -> None:
        """Keep the region in host memory (a resident sub-group): ``image`` holds every chunk's image at
        its offset in the region, and each chunk's buffer becomes a view of it."""
        self.image = image
        base = self.region.offset
        for c in self.chunks:
            c.buffer = image[c.offset - base : c.offset - base + c.image_bytes]


def cut_into_chunks(members: List[Tuple[object, int, int]], chunk_numel: int) -> List[Tuple[int, int, List[Piece]]]:
    """Cut a sub-group, given as (record, flat offset, numel) in flat order, into chunks of at most
    ``chunk_numel`` elements. A parameter is split only at multiples of 4 KiB of its own bytes."""
    chunks, pieces, start, size = [], [], 0, 0

    def close():
        nonlocal pieces, start, size
        if pieces:
            chunks.append((start, size, pieces))
        start, pieces, size = start + size, [], 0

    for rec, _, numel in members:
        step = ALIGN // dtype_bytes(rec.dtype)
        pos = 0
        while pos < numel:
            room = chunk_numel - size
            rest = numel - pos
            if rest <= room:
                take = rest
            else:
                take = room // step * step  # split point at 4 KiB of this parameter
                if take == 0:
                    if size:
                        close()
                        continue
                    take = min(rest, max(step, chunk_numel // step * step))
            pieces.append(Piece(rec, pos, take, size))
            size += take
            pos += take
            if size >= chunk_numel:
                close()
    close()
    return chunks


def lay_out_sub_group(
    index: int,
    members: List[tuple],
    chunk_numel: int,
    parts: int,
    allocate: Callable[[int], "Extent"],
    resident: bool = False,
) -> SubGroup:
    """Sub-group ``index`` of ``members`` (record, flat offset, numel, in flat order): its chunks, their
    images in one region of ``allocate(nbytes)`` (a swap file's allocator), and its gradient extent."""
    numel = sum(m[2] for m in members)
    cut = cut_into_chunks(members, chunk_numel)
    sizes = [parts * align_up(n * FP32_BYTES) for _, n, _ in cut]
    region = allocate(sum(sizes))
    chunks, off = [], region.offset
    for (start, n, pieces), size in zip(cut, sizes):
        chunks.append(Chunk(start, n, off, pieces, parts))
        off += size
    grad_extent = allocate(numel * FP32_BYTES)
    return SubGroup(index, numel, chunks, members, region, grad_extent, resident=resident)
