"""Optimizer state and gradients on NVMe, streamed through a small host working set.

ZeRO-3 (DeepSpeed 0.19) updates its optimizer one *sub-group* at a time: a flat fp32 partition of a run of
parameters, never smaller than the largest parameter in it. DeepSpeed's swapper brings a whole sub-group
(master, moments, gradient: 16 bytes per element) into host buffers, so the host memory it needs grows with
the largest parameter (a 128k-token embedding of a 70B model is 17 GB of state). We stream instead: each
sub-group is cut into *chunks* of at most ``chunk_numel`` elements, and the optimizer steps chunk by
chunk while the next chunks are read and the previous ones written::

    optim.swp, per sub-group:  [ master | exp_avg | exp_avg_sq ] chunk 0, [ ... ] chunk 1, ...
                               [ fp32 gradient of the whole sub-group ]

Adam is elementwise, so stepping chunk by chunk gives the same numbers as stepping the sub-group at once
(the step count is restored before each chunk). After each chunk the updated values are converted to the
model dtype and written to the parameters' extents (and into their cached layer group, if any); chunk
boundaries inside a parameter are placed at 4 KiB of that parameter's bytes so these writes stay O_DIRECT.

Gradients: ZeRO-3 keeps every gradient partition of the model in one host buffer (4 bytes per parameter,
outside any budget). :class:`GradientPartitions` replaces it by one fp32 buffer per sub-group, opened when
its first gradient arrives; under memory pressure a buffer is written to the sub-group's gradient extent
(the sub-groups the step reaches last go first) and read back when more gradients arrive or when the step
needs it. The step uses a gradient buffer in place.

Sub-groups planned as *resident* (the RAM cache tier) keep their whole image and gradient in host memory
for the run; they reach the disk only through checkpoints.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from aidaptiv_ds.store import ALIGN, Extent, Ticket, align_up

log = logging.getLogger(__name__)

FP32 = torch.float32
# Full-size state tensors per parameter the layout has room for (Adam: exp_avg, exp_avg_sq).
STATE_SLOTS = 2
PARTS = 1 + STATE_SLOTS          # master + state slots, per chunk
# Chunks read ahead of the one being updated, as far as the budget allows without waiting.
READ_AHEAD = 2
ADAM_KEYS = ["exp_avg", "exp_avg_sq"]


class UnsupportedOptimizerError(RuntimeError):
    pass


@dataclass(eq=False)
class Piece:
    """Part of one parameter partition covered by a chunk: elements [start, start+numel) of ``record``."""

    record: object      # param_swapper.ParamRecord
    start: int
    numel: int
    flat: int           # offset of the piece in the chunk (elements)


@dataclass(eq=False)
class Chunk:
    start: int          # first element within the sub-group
    numel: int
    offset: int         # file offset of its [master | slots] image
    pieces: List[Piece]
    buffer: Optional[torch.Tensor] = None   # uint8 image, PARTS parts
    read: Optional[Ticket] = None

    @property
    def part(self) -> int:
        return align_up(self.numel * 4)

    def slot(self, k: int) -> torch.Tensor:
        return self.buffer[k * self.part:k * self.part + self.numel * 4].view(FP32)


@dataclass(eq=False)
class SubGroup:
    index: int
    numel: int
    chunks: List[Chunk]
    region: Extent                      # all chunk images, contiguous
    grad_extent: Extent
    resident: bool = False
    image: Optional[torch.Tensor] = None    # resident: the region in host memory
    state_keys: List[str] = field(default_factory=list)
    state_valid: bool = False           # slots hold real values (else they are zeros)
    scalars: Dict[str, object] = field(default_factory=dict)  # e.g. Adam's step count
    # gradients of the current accumulation window
    grad: Optional[torch.Tensor] = None     # fp32 [numel] in host memory
    grad_on_disk: bool = False          # the gradient extent holds this window's values (memory, when
                                        # present, is newer)
    grad_started: bool = False          # this window has gradient values
    pins: int = 0                       # > 0 while its gradients must stay where they are
    # whole-sub-group swap-in, for DeepSpeed's inspection APIs (safe_get_full_*)
    whole: Optional[torch.Tensor] = None

    @property
    def part(self) -> int:
        return align_up(self.numel * 4)


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
        elsize = torch.empty(0, dtype=rec.dtype).element_size()
        step = ALIGN // elsize
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


class AidaptivOptimizerSwapper:
    """The optimizer-swapper interface ZeRO-3 calls, plus the streamed step it does not have."""

    def __init__(self, runtime, optimizer, stage3, chunk_numel: int):
        self.runtime = runtime
        runtime.optimizer_swapper = self
        self.optimizer = optimizer
        self.stage3 = stage3
        self.chunk_numel = chunk_numel
        self.file = runtime.create_optimizer_file()
        # DeepSpeed's checkpoint code copies this folder into the checkpoint (and back on load). Our state
        # is saved by aidaptiv_ds.zero3.checkpoint, so it gets an empty folder rather than our swap files.
        self.swap_folder = runtime.space.deepspeed_dir
        self.groups: Dict[str, SubGroup] = {}  # DeepSpeed's fp32 partition ds_id -> sub-group
        self.by_index: List[SubGroup] = []
        self._writes: List[tuple] = []         # (ticket, buffer kept alive until written, frees memory)
        self._lock = threading.RLock()
        self._prefill_adam = type(optimizer).__name__ == "DeepSpeedCPUAdam"
        runtime.memory.add_reclaimer("optimizer write-behind", self._reclaim_write)
        runtime.memory.add_reclaimer("gradients in host memory", self._reclaim_grad)
        runtime.memory.add_holder("resident optimizer state", lambda: sum(
            sg.region.reserved for sg in self.by_index if sg.resident))
        runtime.memory.add_holder("gradients", lambda: sum(sg.part for sg in self.by_index if sg.grad is not None))
        runtime.memory.add_holder("optimizer writes", lambda: sum(
            b.numel() * b.element_size() for _, b, frees in self._writes if frees))
        runtime.memory.add_holder("optimizer chunks", lambda: sum(
            PARTS * c.part for sg in self.by_index if not sg.resident for c in sg.chunks if c.buffer is not None))

    # ------------------------------------------------------------------ registration
    def register(self, index: int, key: str, members: List[tuple], resident: bool) -> SubGroup:
        """Sub-group ``index`` of ZeRO-3, whose fp32 partition DeepSpeed names ``key``; ``members`` are
        (param record, flat offset, numel) of its partitions in flat order."""
        numel = sum(m[2] for m in members)
        cut = cut_into_chunks(members, self.chunk_numel)
        sizes = [PARTS * align_up(n * 4) for _, n, _ in cut]
        region = self.file.allocate(sum(sizes))
        chunks, off = [], region.offset
        for (start, n, pieces), size in zip(cut, sizes):
            chunks.append(Chunk(start, n, off, pieces))
            off += size
        grad_extent = self.file.allocate(numel * 4)
        sg = SubGroup(index, numel, chunks, region, grad_extent, resident=resident)
        self.groups[key] = sg
        self.by_index.append(sg)
        if resident:
            sg.image = self.runtime.memory.take(region.reserved, f"resident optimizer sub-group {index}")
            sg.image.zero_()
            for c in chunks:
                c.buffer = sg.image[c.offset - region.offset:c.offset - region.offset + PARTS * c.part]
        return sg

    def _sg(self, parameter) -> SubGroup:
        return self.groups[parameter.ds_id]

    # ------------------------------------------------------------------ ZeRO-3's interface
    @staticmethod
    def parameter_id(param):
        return param.ds_id

    def is_swappable_tensor(self, tensor=None, numel=None):
        return True

    def init_timers(self):
        pass

    def log_timers(self):
        pass

    def pre_backward(self):
        pass

    def post_backward(self):
        pass

    def initialize_parameters(self, parameters, src_tensors):
        """Write the initial fp32 master of each sub-group (its moments start at zero)."""
        for param, src in zip(parameters, src_tensors):
            sg = self._sg(param)
            flat = src.reshape(-1)
            for c in sg.chunks:
                if sg.resident:
                    c.slot(0).copy_(flat[c.start:c.start + c.numel])
                    continue
                buf = self.runtime.memory.take(c.part, f"initial master weights of sub-group {sg.index}")
                buf[:c.numel * 4].view(FP32).copy_(flat[c.start:c.start + c.numel])
                t = self.runtime.store.write_span(self.file, c.offset, buf, f"master of sub-group {sg.index}")
                self._writes.append((t, buf, True))

    def initialize_from_swapped_fp16_params(self, *args, **kwargs):
        raise NotImplementedError("aidaptiv configures offload_optimizer.fast_init=false; this path is unused")

    def swap_out_gradients(self, parameter, gradient_offsets, gradient_tensors):
        """ZeRO-3 hands over the final gradients of a bucket at the accumulation boundary. They are views
        into our gradient buffers (see GradientPartitions), already where the step finds them: in host
        memory, or written out with their buffer if memory was needed since."""

    def purge_state(self):
        with self._lock:
            for sg in self.by_index:
                sg.state_keys, sg.state_valid, sg.scalars = [], False, {}

    # Whole-sub-group access, used by DeepSpeed's inspection APIs (safe_get_full_grad and friends) and
    # not by training: assembles master, state and gradient of the sub-group in ordinary memory.
    def swap_in_optimizer_state(self, parameter, async_parameter=None):
        with self._lock:
            sg = self._sg(parameter)
            whole = torch.empty((PARTS + 1) * sg.numel, dtype=FP32)
            for c in sg.chunks:
                self._load_chunk(sg, c, blocking=True)
                self._wait_chunk(c)
                for k in range(PARTS):
                    whole[k * sg.numel + c.start:k * sg.numel + c.start + c.numel].copy_(c.slot(k))
                self._release_chunk(sg, c)
            grad = whole[PARTS * sg.numel:]
            g = self._grad_tensor(sg)
            grad.copy_(g) if g is not None else grad.zero_()
            sg.whole = whole
            parameter.data = whole[:sg.numel]
            parameter.grad = grad
            state = self.optimizer.state.setdefault(parameter, {})
            state.clear()
            state.update(sg.scalars)
            for k, key in enumerate(sg.state_keys or (ADAM_KEYS if self._prefill_adam else [])):
                state[key] = whole[(1 + k) * sg.numel:(2 + k) * sg.numel]

    def swap_out_optimizer_state(self, parameter, async_swap=False):
        self.writeback_optimizer_state_and_gradients(parameter, write_opt_state=True, write_gradients=False)

    def release_swap_buffers(self, parameter):
        with self._lock:
            sg = self._sg(parameter)
            parameter.data = torch.empty(0, dtype=FP32)
            parameter.grad = None
            self.optimizer.state.pop(parameter, None)
            sg.whole = None

    def writeback_optimizer_state_and_gradients(self, parameter, write_opt_state, write_gradients):
        with self._lock:
            sg = self._sg(parameter)
            whole = sg.whole
            if whole is None:
                return
            if write_opt_state:
                state = self.optimizer.state.get(parameter, {})
                keys = [k for k, v in state.items() if torch.is_tensor(v) and v.numel() == sg.numel]
                for c in sg.chunks:
                    self._load_chunk(sg, c, blocking=True)
                    self._wait_chunk(c)
                    c.slot(0).copy_(whole[c.start:c.start + c.numel])
                    for k, key in enumerate(keys):
                        c.slot(1 + k).copy_(state[key][c.start:c.start + c.numel])
                    self._store_chunk(sg, c)
                sg.state_keys = keys or sg.state_keys
                sg.scalars = {k: v for k, v in state.items() if k not in keys}
                sg.state_valid = sg.state_valid or bool(keys)
            if write_gradients:
                g = self._open_grad(sg)
                g.copy_(whole[PARTS * sg.numel:])
            self.release_swap_buffers(parameter)

    # ------------------------------------------------------------------ the streamed step
    def step_sub_group(self, parameter, grad_scale, run_optimizer: Callable[[], None], write_params) -> None:
        """Update sub-group ``parameter`` chunk by chunk.

        ``grad_scale``: factor the gradients are multiplied by first (unscaling and clipping), or None.
        ``run_optimizer``: steps the optimizer on ``parameter`` as it is set up for the current chunk.
        ``write_params(pieces, master)``: writes the chunk's updated values to the parameters.
        """
        with self._lock:
            sg = self._sg(parameter)
            sg.pins += 1
            try:
                grad = self._grad_tensor(sg)  # None: no gradient arrived this window (unused parameters)
                if grad is None:
                    grad = torch.zeros(sg.numel, dtype=FP32)
                before = dict(sg.scalars)
                keys = sg.state_keys or (ADAM_KEYS if self._prefill_adam else [])
                after = before
                chunks = sg.chunks
                for i, c in enumerate(chunks):
                    self._load_chunk(sg, c, blocking=True)
                    for ahead in chunks[i + 1:i + 1 + READ_AHEAD]:  # read ahead without waiting
                        if not self._load_chunk(sg, ahead, blocking=False):
                            break
                    self._wait_chunk(c)
                    g = grad[c.start:c.start + c.numel]
                    if grad_scale is not None:
                        g.mul_(grad_scale)
                    parameter.data = c.slot(0)
                    parameter.grad = g
                    state = self.optimizer.state.setdefault(parameter, {})
                    state.clear()
                    state.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in before.items()})
                    if sg.state_valid or self._prefill_adam:
                        for k, key in enumerate(keys):
                            state[key] = c.slot(1 + k)
                        if self._prefill_adam:
                            state.setdefault("step", 0)
                    run_optimizer()
                    after, keys = self._adopt_state(sg, c, state, keys)
                    write_params(c.pieces, c.slot(0))
                    self._store_chunk(sg, c)
                    self.optimizer.state.pop(parameter, None)
                sg.scalars = after
                sg.state_keys = keys
                sg.state_valid = True
            finally:
                sg.pins -= 1
                parameter.data = torch.empty(0, dtype=FP32)
                parameter.grad = None
            self.reset_gradients(sg)

    def _adopt_state(self, sg: SubGroup, c: Chunk, state: dict, keys: List[str]):
        """Keep the optimizer's state for this chunk: full-size tensors in our slots, scalars aside."""
        tensors = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1 and v.numel() == c.numel]
        if len(tensors) > STATE_SLOTS:
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} keeps {len(tensors)} full-size state tensors per parameter "
                f"({', '.join(tensors)}); aidaptiv has room for {STATE_SLOTS} (the Adam family): use Adam/AdamW")
        if keys and tensors and sorted(tensors) != sorted(keys):
            raise UnsupportedOptimizerError(f"optimizer state keys changed from {keys} to {tensors}")
        keys = keys or tensors
        for k, key in enumerate(keys):
            slot, value = c.slot(1 + k), state[key].reshape(-1)
            if value.data_ptr() != slot.data_ptr():
                slot.copy_(value)  # the optimizer made its own tensor (first step): adopt it
        return {k: v for k, v in state.items() if k not in keys}, keys

    # ------------------------------------------------------------------ chunk I/O
    def _load_chunk(self, sg: SubGroup, c: Chunk, blocking: bool) -> bool:
        if c.buffer is not None:
            return True
        nbytes = PARTS * c.part
        mem = self.runtime.memory
        sg.pins += 1
        try:
            buf = mem.take(nbytes, f"optimizer sub-group {sg.index}") if blocking else mem.try_take(nbytes)
        finally:
            sg.pins -= 1
        if buf is None:
            return False
        c.buffer = buf
        what = f"optimizer sub-group {sg.index}"
        if sg.state_valid:
            c.read = self.runtime.store.read_span(self.file, c.offset, buf, what)  # one request per chunk
        else:  # master only: the slots are zeros until the first step
            buf[c.part:].zero_()
            c.read = self.runtime.store.read_span(self.file, c.offset, buf[:c.part], what)
        return True

    def _wait_chunk(self, c: Chunk) -> None:
        if c.read is not None:
            self.runtime.store.wait(c.read)
            c.read = None

    def _store_chunk(self, sg: SubGroup, c: Chunk) -> None:
        """Write a chunk's image behind and let its buffer go (resident chunks stay)."""
        if sg.resident:
            return
        t = self.runtime.store.write_span(self.file, c.offset, c.buffer, f"optimizer state of sub-group {sg.index}")
        self._writes.append((t, c.buffer, True))
        c.buffer = None

    def _release_chunk(self, sg: SubGroup, c: Chunk) -> None:
        if not sg.resident:
            self._wait_chunk(c)
            c.buffer = None

    # ------------------------------------------------------------------ gradients
    def _open_grad(self, sg: SubGroup) -> torch.Tensor:
        """The fp32 gradient buffer of ``sg`` for this accumulation window (ZeRO-3 copies or adds into it)."""
        with self._lock:
            if sg.grad is not None:
                return sg.grad
            sg.pins += 1
            try:
                buf = self.runtime.memory.take(sg.part, f"gradients of sub-group {sg.index}")
            finally:
                sg.pins -= 1
            grad = buf[:sg.numel * 4].view(FP32)
            if sg.grad_on_disk:
                # Written out under memory pressure (earlier in this backward, or in earlier micro-steps):
                # continue from those values.
                self.runtime.store.wait(self.runtime.store.read_span(
                    self.file, sg.grad_extent.offset, buf[:sg.grad_extent.reserved], f"gradients of sub-group {sg.index}"))
            else:
                grad.zero_()  # first gradient of this window
            sg.grad = grad
            sg.grad_started = True
            return grad

    open_grad = _open_grad

    def _grad_tensor(self, sg: SubGroup) -> Optional[torch.Tensor]:
        """This window's gradient of ``sg`` in host memory (reading it back if it was written out)."""
        if sg.grad is not None:
            return sg.grad
        if sg.grad_on_disk:
            return self._open_grad(sg)
        return None

    def _reclaim_grad(self) -> bool:
        """Write out the gradient buffer of the sub-group the step will reach last, and free it."""
        with self._lock:
            candidates = [sg for sg in self.by_index if sg.grad is not None and sg.pins == 0 and not sg.resident]
            if not candidates:
                return False
            sg = candidates[-1]
            self._sync_device()
            buf = sg.grad.view(torch.uint8)
            t = self.runtime.store.write_span(self.file, sg.grad_extent.offset, buf, f"gradients of sub-group {sg.index}")
            self._writes.append((t, buf, True))
            sg.grad = None
            sg.grad_on_disk = True
            return True

    def reset_gradients(self, sg: SubGroup) -> None:
        """The step consumed the sub-group's gradients: the next window starts from zero."""
        sg.grad = None
        sg.grad_on_disk = False
        sg.grad_started = False

    @staticmethod
    def _sync_device():
        # Gradient partitions reach host buffers through non-blocking device-to-host copies; they must
        # land before a buffer is written out.
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ write-behind
    def _reclaim_write(self) -> bool:
        with self._lock:
            while self._writes:
                t, _, frees = self._writes.pop(0)
                self.runtime.store.wait(t)
                if frees:
                    return True
            return False

    def drain(self) -> None:
        with self._lock:
            items, self._writes = self._writes, []
        for t, _, _ in items:
            self.runtime.store.wait(t)

    def poll(self) -> None:
        with self._lock:
            still = []
            for item in self._writes:
                if item[0].done():
                    self.runtime.store.wait(item[0])
                else:
                    still.append(item)
            self._writes = still


class GradientPartitions:
    """Stands in for ZeRO-3's ``param ds_id -> gradient partition`` dict, backed by per-sub-group buffers.

    ZeRO-3 copies (first micro-step) or adds (later ones) each reduced gradient partition into the tensor
    this returns, then reads it back at the accumulation boundary for the norm. Buffers are opened on first
    use, so only sub-groups that are receiving gradients take host memory.
    """

    def __init__(self, swapper: AidaptivOptimizerSwapper, positions: Dict[int, tuple]):
        self.swapper = swapper
        self.positions = positions  # ds_id -> (SubGroup, offset, numel)

    def __getitem__(self, ds_id):
        sg, offset, numel = self.positions[ds_id]
        return self.swapper.open_grad(sg).narrow(0, offset, numel)

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
