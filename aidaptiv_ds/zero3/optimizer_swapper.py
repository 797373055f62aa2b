"""Optimizer state and gradients on NVMe, streamed through a small host working set.

ZeRO-3 (DeepSpeed 0.19) updates its optimizer one *sub-group* at a time: a flat fp32 partition of a run of
parameters, never smaller than the largest parameter in it. DeepSpeed's swapper brings a whole sub-group
(master, moments, gradient: 16 bytes per element) into host buffers, so the host memory it needs grows with
the largest parameter (a 128k-token embedding of a 70B model is 17 GB of state). We stream instead: each
sub-group is cut into *chunks* of at most ``chunk_numel`` elements and the optimizer steps chunk by chunk,
as one pipeline over all sub-groups, while the next chunks are read and the previous ones written.

Layout of ``optim.swp``, per sub-group (a chunk's *image* is one read and one write)::

    bf16/fp16 model:  [ fp32 master | exp_avg | exp_avg_sq ] per chunk, then the sub-group's fp32 gradient
    fp32 model:       [ exp_avg | exp_avg_sq ] per chunk,               then the sub-group's fp32 gradient

For an fp32 model the master *is* the parameter: the step reads it from the parameters' extents (or uses
the cached layer group in host memory without reading), updates it in place and writes it back once,
instead of keeping a second copy that is read, written, and then converted into the parameter.

Adam is elementwise, so stepping chunk by chunk (or, for fp32 models, parameter piece by piece) gives the
same numbers as stepping the sub-group at once; the step count is restored before each call. Chunk
boundaries inside a parameter fall at 4 KiB of that parameter's bytes, so every write is O_DIRECT.

Gradients: ZeRO-3 keeps every gradient partition of the model in one host buffer (4 bytes per parameter,
outside any budget). :class:`GradientPartitions` replaces it by one fp32 buffer per sub-group, opened when
its first gradient arrives; under memory pressure a buffer is written to the sub-group's gradient extent
(the sub-groups the step reaches last go first) and read back, a chunk's slice at a time, with that chunk.

Sub-groups planned as *resident* (the RAM cache tier) keep their chunk images and gradient in host memory
for the run; they reach the disk only through checkpoints.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from aidaptiv_ds.store import ALIGN, Extent, Ticket, WriteBehind, align_up

log = logging.getLogger(__name__)

FP32 = torch.float32
# Full-size state tensors per parameter the layout has room for (Adam: exp_avg, exp_avg_sq).
STATE_SLOTS = 2
PARTS = 1 + STATE_SLOTS          # image parts per chunk when the master is kept separately
# Chunks read ahead of the one being updated, as far as the budget allows without waiting for I/O.
MAX_AHEAD = 6
READ_AHEAD = 2                   # what the plan reserves room for
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
    offset: int         # file offset of its image
    pieces: List[Piece]
    parts: int          # image parts: master (unless aliased) and state slots
    buffer: Optional[torch.Tensor] = None   # uint8 image (+ the gradient slice, when read with it)
    read: Optional[Ticket] = None
    grad_view: Optional[torch.Tensor] = None  # this chunk's gradient, read from disk with the image
    runs: Optional[list] = None          # fp32 model: MasterRuns holding the pieces' parameters

    @property
    def part(self) -> int:
        return align_up(self.numel * 4)

    @property
    def image_bytes(self) -> int:
        return self.parts * self.part

    def slot(self, k: int) -> torch.Tensor:
        return self.buffer[k * self.part:k * self.part + self.numel * 4].view(FP32)


@dataclass(eq=False)
class SubGroup:
    index: int
    numel: int
    chunks: List[Chunk]
    members: List[tuple]                # (record, flat offset, numel)
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
    pins: int = 0                       # > 0 while its gradients must stay where they are
    whole: Optional[torch.Tensor] = None  # whole-sub-group copy for DeepSpeed's inspection APIs

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
        step = ALIGN // torch.empty(0, dtype=rec.dtype).element_size()
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
        # fp32 model: the master is the parameter (see the module docstring).
        self.alias = runtime.model_dtype == FP32
        self.parts = STATE_SLOTS if self.alias else PARTS
        self.file = runtime.create_optimizer_file()
        # DeepSpeed's checkpoint code copies this folder into the checkpoint (and back on load). Our state
        # is saved by aidaptiv_ds.zero3.checkpoint, so it gets an empty folder rather than our swap files.
        self.swap_folder = runtime.space.make_subdir("deepspeed")
        self.groups: Dict[str, SubGroup] = {}  # DeepSpeed's fp32 partition ds_id -> sub-group
        self.by_index: List[SubGroup] = []
        self._writes = WriteBehind(runtime.store)  # optimizer images and gradients being written
        self._lock = threading.RLock()
        self._pending: List[tuple] = []        # (sub-group, chunk) of the step being applied, in order
        self._cursor = 0                       # chunks of _pending already updated
        self._ctx: dict = {}
        self._last_chunk_of: Dict[int, int] = {}
        self._prefill_adam = type(optimizer).__name__ == "DeepSpeedCPUAdam"
        mem = runtime.memory
        mem.add_reclaimer("finished optimizer writes", self._forget_finished_writes, cheap=True)
        mem.add_reclaimer("optimizer write-behind", self._reclaim_write)
        mem.add_reclaimer("gradients in host memory", self._reclaim_grad)
        mem.add_holder("resident optimizer state", lambda: sum(
            sg.region.reserved for sg in self.by_index if sg.resident))
        mem.add_holder("gradients", lambda: sum(sg.part for sg in self.by_index if sg.grad is not None))
        mem.add_holder("optimizer writes", self._writes.held_bytes)
        mem.add_holder("optimizer chunks", lambda: sum(
            c.image_bytes for sg in self.by_index if not sg.resident for c in sg.chunks if c.buffer is not None))

    # ------------------------------------------------------------------ registration
    def register(self, index: int, key: str, members: List[tuple], resident: bool) -> SubGroup:
        """Sub-group ``index`` of ZeRO-3, whose fp32 partition DeepSpeed names ``key``; ``members`` are
        (param record, flat offset, numel) of its partitions in flat order."""
        numel = sum(m[2] for m in members)
        cut = cut_into_chunks(members, self.chunk_numel)
        sizes = [self.parts * align_up(n * 4) for _, n, _ in cut]
        region = self.file.allocate(sum(sizes))
        chunks, off = [], region.offset
        for (start, n, pieces), size in zip(cut, sizes):
            chunks.append(Chunk(start, n, off, pieces, self.parts))
            off += size
        grad_extent = self.file.allocate(numel * 4)
        sg = SubGroup(index, numel, chunks, members, region, grad_extent, resident=resident)
        self.groups[key] = sg
        self.by_index.append(sg)
        if resident:
            sg.image = self.runtime.memory.take(region.reserved, f"resident optimizer sub-group {index}", large=True)
            sg.image.zero_()
            for c in chunks:
                c.buffer = sg.image[c.offset - region.offset:c.offset - region.offset + c.image_bytes]
        return sg

    def _sg(self, parameter) -> SubGroup:
        return self.groups[parameter.ds_id]

    def _state_slot(self, c: Chunk, k: int) -> torch.Tensor:
        return c.slot(k if self.alias else 1 + k)

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
        """Write the initial fp32 master of each sub-group (its moments start at zero). For an fp32 model
        the parameters already are the masters: nothing to write."""
        if self.alias:
            return
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
                self._writes.add(t, buf, True)

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
            self.flush()
            sg = self._sg(parameter)
            n = sg.numel
            whole = torch.empty((PARTS + 1) * n, dtype=FP32)
            for c in sg.chunks:
                self._load_chunk(sg, c, blocking=True)
                self._wait_chunk(c)
                if self.alias:
                    for p in c.pieces:
                        whole[c.start + p.flat:c.start + p.flat + p.numel].copy_(self._master_view(c, p))
                else:
                    whole[c.start:c.start + c.numel].copy_(c.slot(0))
                for k in range(STATE_SLOTS):
                    whole[(1 + k) * n + c.start:(1 + k) * n + c.start + c.numel].copy_(self._state_slot(c, k))
                self._release_chunk(sg, c)
            grad = whole[PARTS * n:]
            g = self._grad_tensor(sg)
            grad.copy_(g) if g is not None else grad.zero_()
            sg.whole = whole
            parameter.data = whole[:n]
            parameter.grad = grad
            state = self.optimizer.state.setdefault(parameter, {})
            state.clear()
            state.update(sg.scalars)
            for k, key in enumerate(sg.state_keys or (ADAM_KEYS if self._prefill_adam else [])):
                state[key] = whole[(1 + k) * n:(2 + k) * n]

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
            n = sg.numel
            if write_opt_state:
                state = self.optimizer.state.get(parameter, {})
                keys = [k for k, v in state.items() if torch.is_tensor(v) and v.numel() == n]
                if self.alias:  # the master is the parameter
                    self.runtime.param_swapper.write_pieces(
                        [(rec, 0, cnt, whole[off:off + cnt]) for rec, off, cnt in sg.members])
                for c in sg.chunks:
                    self._load_chunk(sg, c, blocking=True, with_master=False)
                    self._wait_chunk(c)
                    if not self.alias:
                        c.slot(0).copy_(whole[c.start:c.start + c.numel])
                    for k, key in enumerate(keys):
                        self._state_slot(c, k).copy_(state[key][c.start:c.start + c.numel])
                    self._store_chunk(sg, c)
                sg.state_keys = keys or sg.state_keys
                sg.scalars = {k: v for k, v in state.items() if k not in keys}
                sg.state_valid = sg.state_valid or bool(keys)
            if write_gradients:
                self._open_grad(sg).copy_(whole[PARTS * n:])
            self.release_swap_buffers(parameter)

    # ------------------------------------------------------------------ the streamed, deferred step
    def begin_step(self, parameters: List[torch.Tensor], grad_scale, run_optimizer: Callable[[int], None],
                   write_params: Callable[[list, torch.Tensor], None], hyperparameters: List[dict],
                   param_groups: List[dict], defer: bool) -> None:
        """Start the optimizer step of every sub-group.

        The update is one pipeline over all chunks in parameter order: while chunk k is updated, the chunks
        after it are being read (as far as the budget allows without waiting) and the ones before it
        written. With ``defer`` (fp32 models, whose masters are the parameters) the chunks are updated
        only when the parameters they hold are next needed (:meth:`apply_pending`, called as the next
        forward fetches them, and :meth:`flush` before anything else may look): the forward's read of a
        layer group then is the optimizer's read of its masters, and the optimizer's I/O overlaps the
        forward's compute. Without it the whole pipeline runs now.

        ``parameters[i]``: DeepSpeed's fp32 partition of sub-group i (pointed at each unit of work in
        turn). ``grad_scale``: the factor gradients are multiplied by first (unscaling and clipping), or
        None. ``run_optimizer(i)``: steps the optimizer on ``parameters[i]`` as set up.
        ``write_params(pieces, master)``: writes a chunk's updated values to separate parameters.
        ``hyperparameters``: this step's values of each optimizer param group (lr, betas, ...), used for
        its updates even after the learning-rate scheduler has moved on. ``param_groups``: the optimizer's.
        """
        with self._lock:
            self.flush()  # a previous step not yet applied everywhere
            self._pending = [(sg, c) for sg in self.by_index for c in sg.chunks]
            self._cursor = 0
            self._ctx = dict(parameters=parameters, grad_scale=grad_scale, run_optimizer=run_optimizer,
                             write_params=write_params, hyperparameters=hyperparameters,
                             param_groups=param_groups,
                             remaining={sg.index: len(sg.chunks) for sg in self.by_index},
                             progress={})
            self._last_chunk_of = {}
            for k, (sg, c) in enumerate(self._pending):
                for p in c.pieces:
                    self._last_chunk_of[p.record.ds_id] = k
            if not defer:
                self.flush()

    def pending(self) -> bool:
        return self._cursor < len(self._pending)

    def apply_pending(self, ds_id) -> None:
        """Make sure the pending update of partition ``ds_id`` is applied (and everything before it)."""
        k = self._last_chunk_of.get(ds_id) if self.pending() else None
        if k is not None and k >= self._cursor:
            self._advance(k + 1)

    def flush(self) -> None:
        """Apply every pending update."""
        if self.pending():
            self._advance(len(self._pending))

    def discard_pending(self) -> None:
        """Forget a pending step (its state was replaced, e.g. by a checkpoint load)."""
        with self._lock:
            for sg, c in self._pending[self._cursor:]:
                if c.buffer is not None or c.runs is not None:
                    self._release_chunk(sg, c)
            self._pending, self._cursor = [], 0

    def _advance(self, upto: int) -> None:
        import time as _time
        t0 = _time.perf_counter()
        with self._lock, torch.no_grad(), self._hyperparameters():
            order, ctx = self._pending, self._ctx
            try:
                while self._cursor < upto:
                    k = self._cursor
                    sg, c = order[k]
                    self._load_chunk(sg, c, blocking=True)
                    for other, ahead in order[k + 1:k + 1 + MAX_AHEAD]:
                        if not self._load_chunk(other, ahead, blocking=False):
                            break
                    self._update_chunk(sg, c, ctx)
                    self._cursor += 1
            except BaseException:
                self.discard_pending()  # never leave chunks or pinned groups behind
                raise
        self.runtime.stats.optimizer_apply_s += _time.perf_counter() - t0

    class _Swap:
        def __init__(self, groups, values):
            self.groups, self.values = groups, values

        def __enter__(self):
            self.saved = []
            for group, values in zip(self.groups, self.values):
                self.saved.append({k: group[k] for k in values if k in group})
                group.update(values)

        def __exit__(self, *exc):
            for group, saved in zip(self.groups, self.saved):
                group.update(saved)

    def _hyperparameters(self):
        """The optimizer's param groups set to the pending step's values while it is applied."""
        return self._Swap(self._ctx["param_groups"], self._ctx["hyperparameters"])

    def _update_chunk(self, sg: SubGroup, c: Chunk, ctx: dict) -> None:
        self._wait_chunk(c)
        progress = ctx["progress"]
        if sg.index not in progress:
            keys = sg.state_keys or (ADAM_KEYS if self._prefill_adam else [])
            progress[sg.index] = (dict(sg.scalars), keys, dict(sg.scalars))
        before, keys, after = progress[sg.index]
        parameter = ctx["parameters"][sg.index]
        grad = self._chunk_grad(sg, c)
        if ctx["grad_scale"] is not None:
            grad.mul_(ctx["grad_scale"])
        units = [(self._master_view(c, p), p.flat, p.numel) for p in c.pieces] if self.alias \
            else [(c.slot(0), 0, c.numel)]
        try:
            for master, lo, n in units:
                parameter.data = master
                parameter.grad = grad[lo:lo + n]
                state = self.optimizer.state.setdefault(parameter, {})
                state.clear()
                state.update({key: (v.clone() if torch.is_tensor(v) else v) for key, v in before.items()})
                if sg.state_valid or self._prefill_adam:
                    for j, key in enumerate(keys):
                        state[key] = self._state_slot(c, j)[lo:lo + n]
                    if self._prefill_adam:
                        state.setdefault("step", 0)
                ctx["run_optimizer"](sg.index)
                after, keys = self._adopt_state(c, lo, n, state, keys)
                self.optimizer.state.pop(parameter, None)
        finally:
            parameter.data = torch.empty(0, dtype=FP32)
            parameter.grad = None
        progress[sg.index] = (before, keys, after)
        if self.alias:
            for r in c.runs:
                self.runtime.param_swapper.store_run(r)
            c.runs = None
        else:
            ctx["write_params"](c.pieces, c.slot(0))
        self._store_chunk(sg, c)
        ctx["remaining"][sg.index] -= 1
        if ctx["remaining"][sg.index] == 0:  # the sub-group is done: its state and gradients move on
            sg.scalars, sg.state_keys, sg.state_valid = after, keys, True
            self.reset_gradients(sg)

    def _master_view(self, c: Chunk, p: Piece) -> torch.Tensor:
        """fp32 model: the parameter piece itself, in the run that holds it."""
        for r in c.runs:
            if r.lo <= p.record.extent.offset + p.start * 4 < r.hi:
                return r.view(p.record, p.start, p.numel)
        raise RuntimeError(f"piece of partition {p.record.ds_id} is not in the chunk's loaded runs")

    def _chunk_grad(self, sg: SubGroup, c: Chunk) -> torch.Tensor:
        """The gradient of chunk ``c``: a slice of the sub-group's buffer in host memory, or the part of
        the chunk's buffer it was read into, or zeros when no gradient arrived this window."""
        if sg.grad is not None:
            return sg.grad[c.start:c.start + c.numel]
        if c.grad_view is not None:
            return c.grad_view
        if sg.grad_on_disk:  # written out after the chunk was loaded: read this chunk's slice now
            return self._read_grad_slice(sg, c)
        return torch.zeros(c.numel, dtype=FP32)

    def _adopt_state(self, c: Chunk, lo: int, n: int, state: dict, keys: List[str]):
        """Keep the optimizer's state for elements [lo, lo+n) of chunk ``c``: full-size tensors in our
        slots, scalars aside."""
        tensors = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1 and v.numel() == n]
        if len(tensors) > STATE_SLOTS:
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} keeps {len(tensors)} full-size state tensors per parameter "
                f"({', '.join(tensors)}); aidaptiv has room for {STATE_SLOTS} (the Adam family): use Adam/AdamW")
        if keys and tensors and sorted(tensors) != sorted(keys):
            raise UnsupportedOptimizerError(f"optimizer state keys changed from {keys} to {tensors}")
        keys = keys or tensors
        for j, key in enumerate(keys):
            slot, value = self._state_slot(c, j)[lo:lo + n], state[key].reshape(-1)
            if value.data_ptr() != slot.data_ptr():
                slot.copy_(value)  # the optimizer made its own tensor (first step): adopt it
        return {k: v for k, v in state.items() if k not in keys}, keys

    # ------------------------------------------------------------------ chunk I/O
    def _grad_cover(self, c: Chunk):
        """Aligned byte range of the gradient extent that holds chunk ``c``'s gradient, and the chunk's
        offset in it (O_DIRECT reads whole 4 KiB blocks)."""
        lo = (c.start * 4) // ALIGN * ALIGN
        return lo, align_up((c.start + c.numel) * 4), c.start * 4 - lo

    def _load_chunk(self, sg: SubGroup, c: Chunk, blocking: bool, with_master: bool = True) -> bool:
        """Start reading chunk ``c``: its image (the state slots only once they hold values), its gradient
        slice when the sub-group's gradients were written out, and, for an fp32 model, the parameter runs
        that are its masters. Returns False only when not blocking and the budget has no room."""
        if c.buffer is not None and (c.runs is not None or not (self.alias and with_master)):
            return True
        mem, store = self.runtime.memory, self.runtime.store
        what = f"optimizer sub-group {sg.index}"
        if c.buffer is None:
            with_grad = sg.grad is None and sg.grad_on_disk and not sg.resident
            glo, ghi, gshift = self._grad_cover(c)
            image = c.image_bytes
            nbytes = image + ((ghi - glo) if with_grad else 0)
            sg.pins += 1
            try:
                buf = mem.take(nbytes, what) if blocking else mem.try_take(nbytes)
            finally:
                sg.pins -= 1
            if buf is None:
                return False
            c.buffer = buf
            requests = []
            if sg.state_valid:
                requests += store.read_span(self.file, c.offset, buf[:image], what).requests
            else:  # the slots are zeros until the first step; a separate master is read alone
                first = 0 if self.alias else c.part
                buf[first:image].zero_()
                if not self.alias:
                    requests += store.read_span(self.file, c.offset, buf[:c.part], what).requests
            if with_grad:
                requests += store.read_span(self.file, sg.grad_extent.offset + glo, buf[image:],
                                            f"gradients of {what}").requests
                c.grad_view = buf[image + gshift:image + gshift + c.numel * 4].view(FP32)
            c.read = Ticket(requests, what)
        if self.alias and with_master and c.runs is None:
            runs = []
            for run in self.runtime.param_swapper._runs([(p.record, p.start, p.numel) for p in c.pieces]):
                r = self.runtime.param_swapper.load_run(run, blocking)
                if r is None:  # no room now: give back what was taken, try again later
                    for taken in runs:
                        self.runtime.param_swapper.release_run(taken)
                    return False
                runs.append(r)
            c.runs = runs
        return True

    def _wait_chunk(self, c: Chunk) -> None:
        if c.read is not None:
            self.runtime.store.wait(c.read)
            c.read = None
        for r in c.runs or ():
            self.runtime.param_swapper.wait_run(r)

    def _read_grad_slice(self, sg: SubGroup, c: Chunk) -> torch.Tensor:
        glo, ghi, gshift = self._grad_cover(c)
        buf = self.runtime.memory.take(ghi - glo, f"gradients of optimizer sub-group {sg.index}")
        self.runtime.store.wait(self.runtime.store.read_span(self.file, sg.grad_extent.offset + glo, buf,
                                                             f"gradients of optimizer sub-group {sg.index}"))
        return buf[gshift:gshift + c.numel * 4].view(FP32)

    def _store_chunk(self, sg: SubGroup, c: Chunk) -> None:
        """Write a chunk's image behind and let its buffer go (resident chunks stay)."""
        if sg.resident:
            return
        t = self.runtime.store.write_span(self.file, c.offset, c.buffer[:c.image_bytes],
                                          f"optimizer state of sub-group {sg.index}")
        self._writes.add(t, c.buffer, True)
        c.buffer = None
        c.grad_view = None

    def _release_runs(self, c: Chunk) -> None:
        for r in c.runs or ():
            self.runtime.param_swapper.release_run(r)
        c.runs = None

    def _release_chunk(self, sg: SubGroup, c: Chunk) -> None:
        self._wait_chunk(c)
        self._release_runs(c)
        if not sg.resident:
            c.buffer = None
            c.grad_view = None

    # ------------------------------------------------------------------ gradients
    def open_grad(self, sg: SubGroup) -> torch.Tensor:
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
            return grad

    _open_grad = open_grad

    def _grad_tensor(self, sg: SubGroup) -> Optional[torch.Tensor]:
        """This window's gradient of ``sg`` in host memory (read back if it was written out)."""
        if sg.grad is not None:
            return sg.grad
        return self.open_grad(sg) if sg.grad_on_disk else None

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
            self._writes.add(t, buf, True)
            sg.grad = None
            sg.grad_on_disk = True
            return True

    def reset_gradients(self, sg: SubGroup) -> None:
        """The step consumed the sub-group's gradients: the next window starts from zero."""
        sg.grad = None
        sg.grad_on_disk = False

    @staticmethod
    def _sync_device():
        # Gradient partitions reach host buffers through non-blocking device-to-host copies; they must
        # land before a buffer is written out.
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ write-behind
    def _forget_finished_writes(self) -> bool:
        with self._lock:
            return self._writes.forget_finished()

    def _reclaim_write(self) -> bool:
        with self._lock:
            return self._writes.finish_oldest()

    def drain(self) -> None:
        self._writes.finish_all(self._lock)

    def poll(self) -> None:
        self._forget_finished_writes()


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
