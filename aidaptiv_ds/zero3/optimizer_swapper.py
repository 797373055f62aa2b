"""DeepSpeed's optimizer-swapper interface on our chunked optimizer state.

ZeRO-3 (DeepSpeed 0.19) updates its optimizer one *sub-group* at a time: a flat fp32 partition of a run of
parameters, never smaller than the largest parameter in it. DeepSpeed's swapper brings a whole sub-group
(master, moments, gradient: 16 bytes per element) into host buffers, so the host memory it needs grows with
the largest parameter (a 128k-token embedding of a 70B model is 17 GB of state). We stream instead: each
sub-group is cut into chunks (:mod:`aidaptiv_ds.swap.chunk_layout`, which also lays out ``optim.swp``) and the
optimizer steps chunk by chunk, as one pipeline over all sub-groups
(:mod:`aidaptiv_ds.zero3.streamed_step`). Gradients live in per-sub-group buffers
(:mod:`aidaptiv_ds.zero3.gradients`).

For an fp32 model the master *is* the parameter: the step reads it from the parameters' extents (or uses
the cached layer group in host memory without reading), updates it in place and writes it back once,
instead of keeping a second copy that is read, written, and then converted into the parameter.

:class:`AidaptivOptimizerSwapper` registers the sub-groups, answers the calls ZeRO-3 makes of its optimizer
swapper (initial masters, whole-sub-group access for DeepSpeed's inspection APIs, stubs for the rest) and
owns the lock and the write-behind queue the step and the gradient buffers share. Sub-groups planned as
*resident* (the RAM cache tier) keep their chunk images and gradient in host memory for the run; they reach
the disk only through checkpoints.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List

import torch

from aidaptiv_ds.swap.budget_split import READ_AHEAD
from aidaptiv_ds.swap.chunk_layout import (
    FP32,
    PARTS,
    STATE_SLOTS,
    SubGroup,
    image_parts,
    lay_out_sub_group,
)
from aidaptiv_ds.swap.host_memory import WriteBehind
from aidaptiv_ds.zero3.gradients import SubGroupGradients
from aidaptiv_ds.zero3.streamed_step import ADAM_KEYS, StreamedStep

# PARTS and READ_AHEAD stay importable from here: aidaptiv_ds.zero3.plan sizes the budget with them.
__all__ = ["AidaptivOptimizerSwapper", "PARTS", "READ_AHEAD"]

log = logging.getLogger(__name__)


class AidaptivOptimizerSwapper:
    """The optimizer-swapper interface ZeRO-3 calls. ``streamed_step`` runs the step it does not have;
    ``gradients`` holds the sub-groups' gradient buffers. ``current_stream``: the accelerator's, or None
    where its copies are synchronous (see SubGroupGradients.note_copies)."""

    def __init__(self, runtime, optimizer, stage3, chunk_numel: int, current_stream=None):
        self.runtime = runtime
        runtime.optimizer_swapper = self
        self.optimizer = optimizer
        self.stage3 = stage3
        self.chunk_numel = chunk_numel
        # fp32 model: the master is the parameter (see the module docstring).
        self.master_is_parameter = runtime.model_dtype == FP32
        self.parts = image_parts(self.master_is_parameter)
        self.file = runtime.create_optimizer_file()
        # DeepSpeed's checkpoint code copies this folder into the checkpoint (and back on load). Our state
        # is saved by aidaptiv_ds.zero3.checkpoint, so it gets an empty folder rather than our swap files.
        self.swap_folder = runtime.space.make_subdir("deepspeed")
        self.groups: Dict[str, SubGroup] = {}  # DeepSpeed's fp32 partition ds_id -> sub-group
        self.by_index: List[SubGroup] = []
        self._writes = WriteBehind(runtime.store)  # optimizer images and gradients being written
        self._lock = threading.RLock()
        mem = runtime.memory
        self.gradients = SubGroupGradients(
            runtime.store, mem, self.file, self.by_index, self._writes, self._lock, current_stream
        )
        self.streamed_step = StreamedStep(
            optimizer,
            runtime.store,
            mem,
            self.file,
            self.by_index,
            self.gradients,
            runtime.param_swapper.cache,
            self._writes,
            self._lock,
            runtime.stats,
            self.master_is_parameter,
        )
        mem.add_reclaimer("finished optimizer writes", self._forget_finished_writes, cheap=True)
        mem.add_reclaimer("optimizer write-behind", self._reclaim_write)
        mem.add_reclaimer("gradients in host memory", self.gradients.reclaim)
        mem.add_holder(
            "resident optimizer state", lambda: sum(sg.region.reserved for sg in self.by_index if sg.resident)
        )
        mem.add_holder("gradients", self.gradients.held_bytes)
        mem.add_holder("optimizer writes", self._writes.held_bytes)
        mem.add_holder(
            "optimizer chunks",
            lambda: sum(
                c.image_bytes for sg in self.by_index if not sg.resident for c in sg.chunks if c.buffer is not None
            ),
        )

    # ------------------------------------------------------------------ registration
    def register(self, index: int, key: str, members: List[tuple], resident: bool) -> SubGroup:
        """Sub-group ``index`` of ZeRO-3, whose fp32 partition DeepSpeed names ``key``; ``members`` are
        (param record, flat offset, numel) of its partitions in flat order."""
        sg = lay_out_sub_group(index, members, self.chunk_numel, self.parts, self.file.allocate, resident)
        self.groups[key] = sg
        self.by_index.append(sg)
        if resident:
            image = self.runtime.memory.take(sg.region.reserved, f"resident optimizer sub-group {index}", large=True)
            image.zero_()
            sg.adopt_image(image)
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
        """Write the initial fp32 master of each sub-group (its moments start at zero). For an fp32 model
        the parameters already are the masters: nothing to write."""
        if self.master_is_parameter:
            return
        for param, src in zip(parameters, src_tensors):
            sg = self._sg(param)
            flat = src.reshape(-1)
            for c in sg.chunks:
                if sg.resident:
                    c.slot(0).copy_(flat[c.start : c.start + c.numel])
                    continue
                buf = self.runtime.memory.take(c.part, f"initial master weights of sub-group {sg.index}")
                buf[: c.numel * 4].view(FP32).copy_(flat[c.start : c.start + c.numel])
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
        step = self.streamed_step
        with self._lock:
            step.flush()
            sg = self._sg(parameter)
            n = sg.numel
            whole = torch.empty((PARTS + 1) * n, dtype=FP32)
            for c in sg.chunks:
                step.load_chunk(sg, c, blocking=True)
                step.wait_chunk(c)
                if self.master_is_parameter:
                    for p in c.pieces:
                        whole[c.start + p.flat : c.start + p.flat + p.numel].copy_(step.master_view(c, p))
                else:
                    whole[c.start : c.start + c.numel].copy_(c.slot(0))
                for k in range(STATE_SLOTS):
                    whole[(1 + k) * n + c.start : (1 + k) * n + c.start + c.numel].copy_(c.state_slot(k))
                step.release_chunk(sg, c)
            grad = whole[PARTS * n :]
            g = self.gradients.tensor(sg)
            grad.copy_(g) if g is not None else grad.zero_()
            sg.whole = whole
            parameter.data = whole[:n]
            parameter.grad = grad
            state = self.optimizer.state.setdefault(parameter, {})
            state.clear()
            state.update(sg.scalars)
            for k, key in enumerate(sg.state_keys or (ADAM_KEYS if step.prefill_adam else [])):
                state[key] = whole[(1 + k) * n : (2 + k) * n]

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
        step = self.streamed_step
        with self._lock:
            sg = self._sg(parameter)
            whole = sg.whole
            if whole is None:
                return
            n = sg.numel
            if write_opt_state:
                state = self.optimizer.state.get(parameter, {})
                keys = [k for k, v in state.items() if torch.is_tensor(v) and v.numel() == n]
                if self.master_is_parameter:
                    self.runtime.param_swapper.cache.write_pieces(
                        [(rec, 0, cnt, whole[off : off + cnt]) for rec, off, cnt in sg.members]
                    )
                for c in sg.chunks:
                    step.load_chunk(sg, c, blocking=True, with_master=False)
                    step.wait_chunk(c)
                    if not self.master_is_parameter:
                        c.slot(0).copy_(whole[c.start : c.start + c.numel])
                    for k, key in enumerate(keys):
                        c.state_slot(k).copy_(state[key][c.start : c.start + c.numel])
                    step.store_chunk(sg, c)
                sg.state_keys = keys or sg.state_keys
                sg.scalars = {k: v for k, v in state.items() if k not in keys}
                sg.state_valid = sg.state_valid or bool(keys)
            if write_gradients:
                self.gradients.open(sg).copy_(whole[PARTS * n :])
            self.release_swap_buffers(parameter)

    # ------------------------------------------------------------------ write-behind
    def _forget_finished_writes(self) -> bool:
        with self._lock:
            return self._writes.forget_finished()

    def _reclaim_write(self) -> bool:
        with self._lock:
            return self._writes.finish_oldest()

    def drain(self) -> None:
        """Wait for every write of optimizer state and gradients."""
        self._writes.finish_all(self._lock)

    def poll(self) -> None:
        """Forget finished writes so their buffers return to the pool (raising if one failed)."""
        self._forget_finished_writes()
