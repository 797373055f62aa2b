"""Optimizer state and gradients on NVMe, a ZeRO-3 sub-group at a time.

:class:`AidaptivOptimizerSwapper` offers the interface ZeRO-3 (DeepSpeed 0.19) calls on its
``optimizer_swapper``. For each optimizer sub-group (DeepSpeed's flat fp32 partition of a run of
parameters) the swap file holds one contiguous span::

    [ fp32 master | state 0 (exp_avg) | state 1 (exp_avg_sq) | fp32 gradient ]

so that the optimizer step moves a sub-group in one read and one write. The step is pipelined: while Adam
runs on sub-group i, sub-groups i+1 and i+2 are being read (as far as the host budget allows) and i-1 is
being written; the step returns without waiting for the last writes (a later read of those bytes waits).

Gradients: DeepSpeed keeps every gradient partition of the model in one host buffer (4 bytes per
parameter, whatever the budget). We replace that buffer by :class:`GradientPartitions`, which hands
DeepSpeed views into one fp32 buffer per sub-group, opened when the first gradient of the sub-group arrives.
A sub-group's gradients stay in host memory while the budget allows and are written to their place in the
span when memory is needed; the step uses them in place (no copy) or reads them with the rest of the span.

Sub-groups planned as *resident* keep their whole span in host memory for the run (the RAM cache tier):
their gradients accumulate in place and they never touch the disk until a checkpoint or exit.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from aidaptiv_ds.store import Extent, Ticket, align_up

log = logging.getLogger(__name__)

FP32 = torch.float32
# Full-size state tensors per parameter the span has room for (Adam: exp_avg, exp_avg_sq).
STATE_SLOTS = 2
# How many sub-groups ahead the step reads while one is being updated, budget permitting.
READ_AHEAD = 2


class UnsupportedOptimizerError(RuntimeError):
    pass


@dataclass(eq=False)
class SubGroup:
    index: int
    numel: int
    span: Extent                        # [master | state slots | grad]
    members: List[tuple]                # (ds_id, offset, numel, has_data) in flat order
    resident: bool = False
    buffer: Optional[torch.Tensor] = None   # uint8, master + state slots (+ grad if read with them)
    buffer_has_grad: bool = False
    read: Optional[Ticket] = None
    state_keys: List[str] = field(default_factory=list)
    state_valid: bool = False           # state slots hold real values (else they are zeros)
    scalars: Dict[str, object] = field(default_factory=dict)  # e.g. Adam's step count
    # gradients of the current accumulation window
    grad: Optional[torch.Tensor] = None     # fp32 [numel] in host memory (resident: a view of buffer)
    grad_on_disk: bool = False          # the span's grad part holds this window's gradients (written out
                                        # under memory pressure); host memory, when present, is newer
    grad_started: bool = False          # resident: the span's grad part holds this window's gradients
    grad_dirty: bool = False            # grad has values not yet on disk
    grad_touched: set = field(default_factory=set)
    grad_expected: int = 0
    grad_complete: bool = False
    pins: int = 0                       # > 0 while being loaded: its gradients must stay where they are

    @property
    def part(self) -> int:
        return align_up(self.numel * 4)

    def slice(self, k: int, dtype=FP32) -> torch.Tensor:
        """Part k of the span buffer (0 master, 1.. state slots, STATE_SLOTS+1 grad) as fp32."""
        return self.buffer[k * self.part:k * self.part + self.numel * 4].view(dtype)


class AidaptivOptimizerSwapper:
    """ZeRO-3's optimizer-swapper interface on our store."""

    def __init__(self, runtime, optimizer, stage3):
        self.runtime = runtime
        runtime.optimizer_swapper = self
        self.optimizer = optimizer
        self.stage3 = stage3                  # for micro_step_id / accumulation boundary only
        self.file = runtime.create_optimizer_file()
        # DeepSpeed's checkpoint code copies this folder into the checkpoint (and back on load). Our state
        # is saved by aidaptiv_ds.zero3.checkpoint, so it gets an empty folder rather than our swap files.
        self.swap_folder = runtime.space.deepspeed_dir
        self.groups: Dict[str, SubGroup] = {}  # DeepSpeed's fp32 partition ds_id -> sub-group
        self.by_index: List[SubGroup] = []
        self.initializing = False
        self._writes: List[tuple] = []         # (ticket, buffer kept alive, frees memory)
        self._lock = threading.RLock()
        self._prefill_adam = type(optimizer).__name__ == "DeepSpeedCPUAdam"
        runtime.memory.add_reclaimer("optimizer write-behind", self._reclaim_write)
        runtime.memory.add_reclaimer("gradients in host memory", self._reclaim_grad)

    # ------------------------------------------------------------------ registration
    def register(self, index: int, key: str, members: List[tuple], resident: bool) -> SubGroup:
        """Sub-group ``index`` of ZeRO-3, whose fp32 partition DeepSpeed will name ``key`` (its ds_id);
        ``members`` are (ds_id, offset, numel, has_data) of its parameter partitions in flat order."""
        numel = sum(m[2] for m in members)
        span = self.file.allocate((2 + STATE_SLOTS) * align_up(numel * 4))
        sg = SubGroup(index, numel, span, members, resident=resident)
        sg.grad_expected = sum(1 for m in members if m[3])
        self.groups[key] = sg
        self.by_index.append(sg)
        if resident:
            sg.buffer = self.runtime.memory.take(span.reserved, f"resident optimizer sub-group {index}")
            sg.buffer_has_grad = True
            sg.slice(1).zero_()
            sg.slice(2).zero_()
        return sg

    def _sg(self, parameter) -> SubGroup:
        return self.groups[parameter.ds_id]

    # ------------------------------------------------------------------ DeepSpeed's interface
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
        """End of a backward pass: every gradient of this micro-step has arrived."""
        with self._lock:
            for sg in self.by_index:
                if sg.grad is not None:
                    sg.grad_complete = True

    def initialize_parameters(self, parameters, src_tensors):
        """Write the initial fp32 master of each sub-group (``src_tensors``); state starts at zero."""
        for param, src in zip(parameters, src_tensors):
            sg = self._sg(param)
            if sg.resident:
                sg.slice(0).copy_(src.reshape(-1))
                continue
            buf = self.runtime.memory.take(sg.part, f"initial master weights of sub-group {sg.index}")
            buf[:sg.numel * 4].view(FP32).copy_(src.reshape(-1))
            t = self.runtime.store.write_span(self.file, sg.span.offset, buf, f"master of sub-group {sg.index}")
            self._writes.append((t, buf, True))

    def initialize_from_swapped_fp16_params(self, fp16_partitions_info, fp16_num_elems, fp16_pinned_buffers,
                                            fp32_parameters):
        raise NotImplementedError("aidaptiv configures offload_optimizer.fast_init=false; this path is unused")

    def swap_in_optimizer_state(self, parameter, async_parameter=None):
        """Bring a sub-group's master, state and gradients into host memory and hand them to the optimizer."""
        with self._lock:
            sg = self._sg(parameter)
            self._load(sg, blocking=True)
            self._wait_read(sg)
            parameter.data = sg.slice(0)
            state = self.optimizer.state.setdefault(parameter, {})
            state.clear()
            state.update(sg.scalars)
            if sg.state_keys:
                for k, key in enumerate(sg.state_keys):
                    state[key] = sg.slice(1 + k)
            elif self._prefill_adam:
                # DeepSpeedCPUAdam creates exactly these on its first step; giving it our (zeroed) slots
                # saves allocating and copying them.
                sg.state_keys = ["exp_avg", "exp_avg_sq"]
                state.setdefault("step", 0)
                for k, key in enumerate(sg.state_keys):
                    state[key] = sg.slice(1 + k)
            parameter.grad = self._grad_for_step(sg)
            # Read ahead the sub-groups that follow, as far as the budget allows without waiting.
            nxt = sg.index + 1
            for other in self.by_index[nxt:nxt + READ_AHEAD]:
                if not self._load(other, blocking=False):
                    break

    def swap_out_optimizer_state(self, parameter, async_swap=False):
        """Take the updated master and state back; write them behind (resident sub-groups stay in RAM)."""
        with self._lock:
            sg = self._sg(parameter)
            self._adopt_state(sg, parameter)
            parameter.data = torch.empty(0, dtype=FP32)
            parameter.grad = None
            self.reset_gradients(sg)
            if sg.resident:
                return
            if not self.initializing:
                nbytes = (1 + STATE_SLOTS) * sg.part
                t = self.runtime.store.write_span(self.file, sg.span.offset, sg.buffer[:nbytes],
                                                  f"optimizer state of sub-group {sg.index}")
                self._writes.append((t, sg.buffer, True))
            sg.buffer = None
            sg.buffer_has_grad = False

    def release_swap_buffers(self, parameter):
        """Drop a sub-group's host copy without writing it (nothing was changed)."""
        with self._lock:
            sg = self._sg(parameter)
            parameter.data = torch.empty(0, dtype=FP32)
            parameter.grad = None
            self.optimizer.state.pop(parameter, None)
            if not sg.resident:
                self._wait_read(sg)
                sg.buffer = None
                sg.buffer_has_grad = False

    def writeback_optimizer_state_and_gradients(self, parameter, write_opt_state, write_gradients):
        with self._lock:
            sg = self._sg(parameter)
            if write_opt_state:
                self._adopt_state(sg, parameter)
            if sg.resident:
                return
            if write_opt_state:
                nbytes = (1 + STATE_SLOTS) * sg.part
                self.runtime.store.wait(self.runtime.store.write_span(self.file, sg.span.offset,
                                                                      sg.buffer[:nbytes], "optimizer state"))
            if write_gradients and parameter.grad is not None:
                self._spill_grad(sg, parameter.grad, wait=True)
            self.release_swap_buffers(parameter)

    def swap_out_gradients(self, parameter, gradient_offsets, gradient_tensors):
        """DeepSpeed hands over the final gradients of a bucket at the accumulation boundary. They are
        views into our gradient buffers (see GradientPartitions), already where the step will find them:
        in host memory, or written out with their buffer if memory was needed since."""

    def purge_state(self):
        with self._lock:
            for sg in self.by_index:
                sg.state_keys = []
                sg.state_valid = False
                sg.scalars = {}

    # ------------------------------------------------------------------ gradients
    def open_grad(self, sg: SubGroup) -> torch.Tensor:
        """The fp32 gradient buffer of ``sg`` for the current micro-step (DeepSpeed copies or adds into it)."""
        with self._lock:
            if sg.grad is not None:
                return sg.grad
            if sg.resident:
                sg.grad = sg.slice(1 + STATE_SLOTS)
                if not sg.grad_started:  # first gradient of this window
                    sg.grad.zero_()
                    sg.grad_started = True
                return sg.grad
            buf = self.runtime.memory.take(sg.part, f"gradients of sub-group {sg.index}")
            grad = buf[:sg.numel * 4].view(FP32)
            if not sg.grad_on_disk:
                grad.zero_()  # first gradient of this accumulation window
            else:
                # Gradients of this window were written out under memory pressure (earlier in this
                # backward or in earlier micro-steps): continue from them.
                t = self.runtime.store.read_span(self.file, sg.span.offset + (1 + STATE_SLOTS) * sg.part,
                                                 buf[:sg.part], f"gradients of sub-group {sg.index}")
                self.runtime.store.wait(t)
            sg.grad = grad
            sg.grad_dirty = True
            sg.grad_complete = False
            return grad

    def note_grad(self, sg: SubGroup, ds_id) -> None:
        sg.grad_touched.add(ds_id)
        if len(sg.grad_touched) >= sg.grad_expected:
            sg.grad_complete = True  # every partition with data has its gradient for this micro-step

    def _spill_grad(self, sg: SubGroup, grad: torch.Tensor, wait: bool) -> None:
        buf = grad.view(torch.uint8)
        t = self.runtime.store.write_span(self.file, sg.span.offset + (1 + STATE_SLOTS) * sg.part,
                                          buf, f"gradients of sub-group {sg.index}")
        if wait:
            self.runtime.store.wait(t)
        else:
            self._writes.append((t, buf, True))
        sg.grad_on_disk = True

    def _reclaim_grad(self) -> bool:
        """Write out the gradients of a complete sub-group (or, failing that, any) and free them."""
        with self._lock:
            candidates = [sg for sg in self.by_index if sg.grad is not None and not sg.resident
                          and sg.buffer is None and sg.pins == 0]
            if not candidates:
                return False
            complete = [sg for sg in candidates if sg.grad_complete]
            sg = (complete or candidates)[0]
            self._sync_device()
            grad, sg.grad = sg.grad, None
            if sg.grad_dirty:
                self._spill_grad(sg, grad, wait=False)
            sg.grad_dirty = False
            sg.grad_touched = set()
            return True

    def _grad_for_step(self, sg: SubGroup) -> Optional[torch.Tensor]:
        if sg.resident:
            if not sg.grad_started:
                sg.slice(1 + STATE_SLOTS).zero_()
            return sg.slice(1 + STATE_SLOTS)
        if sg.grad is not None:
            return sg.grad                     # still in host memory: used in place
        if sg.buffer_has_grad and sg.grad_on_disk:
            return sg.slice(1 + STATE_SLOTS)   # read together with the span
        # No gradient arrived this window (frozen or unused parameters): zeros.
        return torch.zeros(sg.numel, dtype=FP32)

    def reset_gradients(self, sg: SubGroup) -> None:
        """The step consumed the sub-group's gradients: the next window starts from zero."""
        sg.grad = None
        sg.grad_on_disk = False
        sg.grad_started = False
        sg.grad_dirty = False
        sg.grad_touched = set()
        sg.grad_complete = False

    @staticmethod
    def _sync_device():
        # Gradient partitions reach host buffers through non-blocking device-to-host copies; they must
        # land before the buffer is written out.
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ span I/O
    def _load(self, sg: SubGroup, blocking: bool) -> bool:
        """Start reading ``sg``'s span into a new host buffer: master, the state slots once they hold
        values (zeros before the first step), and the gradients when they were written out."""
        if sg.buffer is not None:
            return True
        # Pinned while taking memory: the reclaimers must not write this sub-group's gradients out from
        # under the decision below of whether to read them.
        sg.pins += 1
        try:
            with_grad = sg.grad is None and sg.grad_on_disk
            nbytes = (1 + STATE_SLOTS + (1 if with_grad else 0)) * sg.part
            mem = self.runtime.memory
            buf = mem.take(nbytes, f"optimizer sub-group {sg.index}") if blocking else mem.try_take(nbytes)
        finally:
            sg.pins -= 1
        if buf is None:
            return False
        sg.buffer = buf
        sg.buffer_has_grad = with_grad
        store, base, what = self.runtime.store, sg.span.offset, f"optimizer sub-group {sg.index}"
        if sg.state_valid:
            ticket = store.read_span(self.file, base, buf, what)  # one request for the whole span
        else:
            buf[sg.part:(1 + STATE_SLOTS) * sg.part].zero_()
            ticket = store.read_span(self.file, base, buf[:sg.part], what)
            if with_grad:
                g0 = (1 + STATE_SLOTS) * sg.part
                ticket = Ticket(ticket.requests + store.read_span(self.file, base + g0, buf[g0:], what).requests,
                                what)
        sg.read = ticket
        return True

    def _wait_read(self, sg: SubGroup) -> None:
        if sg.read is not None:
            self.runtime.store.wait(sg.read)
            sg.read = None

    def _adopt_state(self, sg: SubGroup, parameter) -> None:
        """Record the optimizer's per-parameter state: full-size tensors into our slots, scalars aside."""
        state = self.optimizer.state.pop(parameter, {})
        keys, scalars = [], {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.numel() == sg.numel and value.dim() >= 1:
                keys.append(key)
            else:
                scalars[key] = value
        if len(keys) > STATE_SLOTS:
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} keeps {len(keys)} full-size state tensors per parameter "
                f"({', '.join(keys)}); aidaptiv has room for {STATE_SLOTS} (the Adam family): use Adam/AdamW")
        if sg.state_keys and sorted(keys) != sorted(sg.state_keys) and keys:
            raise UnsupportedOptimizerError(f"optimizer state keys changed from {sg.state_keys} to {keys}")
        if keys:
            if not sg.state_keys:
                sg.state_keys = keys
            for k, key in enumerate(sg.state_keys):
                slot = sg.slice(1 + k)
                value = state[key].reshape(-1)
                if value.data_ptr() != slot.data_ptr():
                    slot.copy_(value)  # the optimizer made its own tensor (first step): adopt it
        sg.scalars = scalars
        if not self.initializing:
            sg.state_valid = True

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
    this returns, then reads it back at the accumulation boundary for the norm. The buffers are opened on
    first use in a micro-step, so only the sub-groups that are receiving gradients take host memory.
    """

    def __init__(self, swapper: AidaptivOptimizerSwapper, positions: Dict[int, tuple]):
        self.swapper = swapper
        self.positions = positions  # ds_id -> (SubGroup, offset, numel)

    def __getitem__(self, ds_id):
        sg, offset, numel = self.positions[ds_id]
        grad = self.swapper.open_grad(sg)
        self.swapper.note_grad(sg, ds_id)
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
