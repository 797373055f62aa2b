"""The optimizer step streamed chunk by chunk through a small host working set, applied now or deferred.

The update is one pipeline over every chunk of every sub-group in parameter order: while chunk k is
updated, the chunks after it are being read (up to ``MAX_AHEAD``, as far as the budget allows without
waiting for I/O) and the ones before it written behind. Adam is elementwise, so stepping chunk by chunk
(or, for fp32 models, parameter piece by piece) gives the same numbers as stepping the sub-group at once;
the optimizer's state is restored before each call and its scalars (Adam's step count) advance once per
sub-group.

For an fp32 model the master *is* the parameter: a chunk's masters are runs of the parameter swap file,
taken from the layer-group cache (:meth:`~aidaptiv_ds.swap.layer_group_cache.LayerGroupCache.load_run`),
updated in place and written back once through it. Such a step may be *deferred*: each chunk is updated
only when the parameters it holds are next needed (:meth:`StreamedStep.apply_pending`, called as the next
forward fetches them) and everything else by :meth:`StreamedStep.flush`, so the forward's read of a layer
group is the optimizer's read of its masters and the optimizer's I/O overlaps the forward's compute.
"""

from __future__ import annotations

import time
from typing import Callable, List

import torch

from aidaptiv_ds.swap.chunk_layout import FP32, STATE_SLOTS, Chunk, Piece, SubGroup
from aidaptiv_ds.swap.store import Ticket

# Chunks read ahead of the one being updated, as far as the budget allows without waiting for I/O.
MAX_AHEAD = 6
ADAM_KEYS = ["exp_avg", "exp_avg_sq"]


class UnsupportedOptimizerError(RuntimeError):
    pass


class _Swap:
    """Sets the optimizer's param groups to a step's values for the duration of a ``with``."""

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


class StreamedStep:
    """Chunk I/O and the pipelined, possibly deferred, update of ``sub_groups`` (shared with the optimizer
    swapper, which appends to it). ``file`` is the optimizer swap file, ``writes`` (a store.WriteBehind) the
    optimizer swapper's write-behind and ``lock`` its lock; ``param_cache`` is the layer-group cache that
    holds the masters when ``master_is_parameter``."""

    def __init__(
        self,
        optimizer,
        store,
        memory,
        file,
        sub_groups: List[SubGroup],
        gradients,
        param_cache,
        writes,
        lock,
        stats,
        master_is_parameter: bool,
    ):
        self.optimizer = optimizer
        self.store = store
        self.memory = memory
        self.file = file
        self.sub_groups = sub_groups
        self.gradients = gradients
        self.param_cache = param_cache
        self.writes = writes
        self.lock = lock
        self.stats = stats
        self.master_is_parameter = master_is_parameter
        # DeepSpeed's CPU Adam keeps no state of its own before the first step: hand it zeroed slots.
        self.prefill_adam = type(optimizer).__name__ == "DeepSpeedCPUAdam"
        self._pending: List[tuple] = []  # (sub-group, chunk) of the step being applied, in order
        self._cursor = 0  # chunks of _pending already updated
        self._ctx: dict = {}
        self._last_chunk_of = {}
        self._in_step = False  # inside begin(), i.e. inside the optimizer's step()

    # ------------------------------------------------------------------ the step
    def begin(
        self,
        parameters: List[torch.Tensor],
        grad_scale,
        run_optimizer: Callable[[int], None],
        write_params: Callable[[list, torch.Tensor], None],
        hyperparameters: List[dict],
        param_groups: List[dict],
        defer: bool,
    ) -> None:
        """Start the optimizer step of every sub-group; with ``defer``, apply it only as its parameters are
        needed (see the module docstring), otherwise now.

        ``parameters[i]``: DeepSpeed's fp32 partition of sub-group i (pointed at each unit of work in
        turn). ``grad_scale``: the factor gradients are multiplied by first (unscaling and clipping), or
        None. ``run_optimizer(i)``: steps the optimizer on ``parameters[i]`` as set up.
        ``write_params(pieces, master)``: writes a chunk's updated values to separate parameters.
        ``hyperparameters``: this step's values of each optimizer param group (lr, betas, ...), used for
        its updates even after the learning-rate scheduler has moved on. ``param_groups``: the optimizer's.
        """
        with self.lock:
            self._in_step = True
            try:
                self._begin(parameters, grad_scale, run_optimizer, write_params, hyperparameters, param_groups, defer)
            finally:
                self._in_step = False

    def _begin(self, parameters, grad_scale, run_optimizer, write_params, hyperparameters, param_groups, defer):
        self.flush()  # a previous step not yet applied everywhere
        self._pending = [(sg, c) for sg in self.sub_groups for c in sg.chunks]
        self._cursor = 0
        self._ctx = dict(
            parameters=parameters,
            grad_scale=grad_scale,
            run_optimizer=run_optimizer,
            write_params=write_params,
            hyperparameters=hyperparameters,
            param_groups=param_groups,
            remaining={sg.index: len(sg.chunks) for sg in self.sub_groups},
            progress={},
        )
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
        with self.lock:
            for sg, c in self._pending[self._cursor :]:
                if c.buffer is not None or c.runs is not None:
                    self.release_chunk(sg, c)
            self._pending, self._cursor = [], 0

    def _advance(self, upto: int) -> None:
        t0 = time.perf_counter()
        with self.lock, torch.no_grad(), _Swap(self._ctx["param_groups"], self._ctx["hyperparameters"]):
            order, ctx = self._pending, self._ctx
            try:
                while self._cursor < upto:
                    k = self._cursor
                    sg, c = order[k]
                    self.load_chunk(sg, c, blocking=True)
                    for other, ahead in order[k + 1 : k + 1 + MAX_AHEAD]:
                        if not self.load_chunk(other, ahead, blocking=False):
                            break
                    self._update_chunk(sg, c, ctx)
                    self._cursor += 1
            except BaseException:
                self.discard_pending()  # never leave chunks or pinned groups behind
                raise
        elapsed = time.perf_counter() - t0
        self.stats.optimizer_apply_s += elapsed
        if not self._in_step:
            self.stats.optimizer_apply_deferred_s += elapsed

    def _update_chunk(self, sg: SubGroup, c: Chunk, ctx: dict) -> None:
        self.wait_chunk(c)
        progress = ctx["progress"]
        if sg.index not in progress:
            keys = sg.state_keys or (ADAM_KEYS if self.prefill_adam else [])
            progress[sg.index] = (dict(sg.scalars), keys, dict(sg.scalars))
        before, keys, after = progress[sg.index]
        parameter = ctx["parameters"][sg.index]
        grad = self.gradients.of_chunk(sg, c)
        if ctx["grad_scale"] is not None:
            grad.mul_(ctx["grad_scale"])
        units = (
            [(self.master_view(c, p), p.flat, p.numel) for p in c.pieces]
            if self.master_is_parameter
            else [(c.slot(0), 0, c.numel)]
        )
        try:
            for master, lo, n in units:
                parameter.data = master
                parameter.grad = grad[lo : lo + n]
                state = self.optimizer.state.setdefault(parameter, {})
                state.clear()
                state.update({key: (v.clone() if torch.is_tensor(v) else v) for key, v in before.items()})
                if sg.state_valid or self.prefill_adam:
                    for j, key in enumerate(keys):
                        state[key] = c.state_slot(j)[lo : lo + n]
                    if self.prefill_adam:
                        state.setdefault("step", 0)
                ctx["run_optimizer"](sg.index)
                after, keys = self._adopt_state(c, lo, n, state, keys)
                self.optimizer.state.pop(parameter, None)
        finally:
            parameter.data = torch.empty(0, dtype=FP32)
            parameter.grad = None
        progress[sg.index] = (before, keys, after)
        if self.master_is_parameter:
            for r in c.runs:
                self.param_cache.store_run(r)
            c.runs = None
        else:
            ctx["write_params"](c.pieces, c.slot(0))
        self.store_chunk(sg, c)
        ctx["remaining"][sg.index] -= 1
        if ctx["remaining"][sg.index] == 0:  # the sub-group is done: its state and gradients move on
            sg.scalars, sg.state_keys, sg.state_valid = after, keys, True
            self.gradients.reset(sg)

    def _adopt_state(self, c: Chunk, lo: int, n: int, state: dict, keys: List[str]):
        """Keep the optimizer's state for elements [lo, lo+n) of chunk ``c``: full-size tensors in our
        slots, scalars aside."""
        tensors = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1 and v.numel() == n]
        if len(tensors) > STATE_SLOTS:
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} keeps {len(tensors)} full-size state tensors per parameter "
                f"({', '.join(tensors)}); aidaptiv has room for {STATE_SLOTS} (the Adam family): use Adam/AdamW"
            )
        if keys and tensors and sorted(tensors) != sorted(keys):
            raise UnsupportedOptimizerError(f"optimizer state keys changed from {keys} to {tensors}")
        keys = keys or tensors
        for j, key in enumerate(keys):
            slot, value = c.state_slot(j)[lo : lo + n], state[key].reshape(-1)
            if value.data_ptr() != slot.data_ptr():
                slot.copy_(value)  # the optimizer made its own tensor (first step): adopt it
        return {k: v for k, v in state.items() if k not in keys}, keys

    # ------------------------------------------------------------------ chunk I/O
    def master_view(self, c: Chunk, p: Piece) -> torch.Tensor:
        """fp32 model: the parameter piece itself, in the run that holds it."""
        for r in c.runs:
            if r.lo <= p.record.extent.offset + p.start * 4 < r.hi:
                return r.view(p.record, p.start, p.numel)
        raise RuntimeError(f"piece of partition {p.record.ds_id} is not in the chunk's loaded runs")

    def load_chunk(self, sg: SubGroup, c: Chunk, blocking: bool, with_master: bool = True) -> bool:
        """Start reading chunk ``c``: its image (the state slots only once they hold values), its gradient
        slice when the sub-group's gradients were written out, and, for an fp32 model, the parameter runs
        that are its masters. Returns False only when not blocking and the budget has no room."""
        master_is_param = self.master_is_parameter
        if c.buffer is not None and (c.runs is not None or not (master_is_param and with_master)):
            return True
        mem, store = self.memory, self.store
        what = f"optimizer sub-group {sg.index}"
        if c.buffer is None:
            with_grad = sg.grad is None and sg.grad_on_disk and not sg.resident
            glo, ghi, gshift = c.grad_cover()
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
                buf[c.state_start : image].zero_()
                if not master_is_param:
                    requests += store.read_span(self.file, c.offset, buf[: c.part], what).requests
            if with_grad:
                requests += store.read_span(
                    self.file, sg.grad_extent.offset + glo, buf[image:], f"gradients of {what}"
                ).requests
                c.grad_view = buf[image + gshift : image + gshift + c.numel * 4].view(FP32)
            c.read = Ticket(requests, what)
        if master_is_param and with_master and c.runs is None:
            cache = self.param_cache
            runs = []
            for run in cache.runs([(p.record, p.start, p.numel) for p in c.pieces]):
                r = cache.load_run(run, blocking)
                if r is None:  # no room now: give back what was taken, try again later
                    for taken in runs:
                        cache.release_run(taken)
                    return False
                runs.append(r)
            c.runs = runs
        return True

    def wait_chunk(self, c: Chunk) -> None:
        if c.read is not None:
            self.store.wait(c.read)
            c.read = None
        for r in c.runs or ():
            self.param_cache.wait_run(r)

    def store_chunk(self, sg: SubGroup, c: Chunk) -> None:
        """Write a chunk's image behind and let its buffer go (resident chunks stay)."""
        if sg.resident:
            return
        t = self.store.write_span(
            self.file, c.offset, c.buffer[: c.image_bytes], f"optimizer state of sub-group {sg.index}"
        )
        self.writes.add(t, c.buffer, True)
        c.buffer = None
        c.grad_view = None

    def release_chunk(self, sg: SubGroup, c: Chunk) -> None:
        """Let go of a chunk without writing it."""
        self.wait_chunk(c)
        for r in c.runs or ():
            self.param_cache.release_run(r)
        c.runs = None
        if not sg.resident:
            c.buffer = None
            c.grad_view = None
