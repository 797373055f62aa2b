"""Apply an activation policy (``aidaptiv.activations``) to a model: keep, recompute, or store on NVMe; and
the chunked loss.

- ``keep``: the model as it is.
- ``recompute``: every transformer block is a checkpoint (``torch.utils.checkpoint`` without re-entry):
  the forward keeps only each block's input, and the backward runs the block again. Hugging Face models
  get their own ``gradient_checkpointing_enable(use_reentrant=False)``; other models with a list of blocks
  (:func:`aidaptiv_ds.zero3.layer_groups.find_block_list`'s rule, repeated here without DeepSpeed) get each
  block's forward wrapped.
- ``nvme``: ``recompute``, and the tensors those checkpoints keep go to an
  :class:`aidaptiv_ds.activations.store.ActivationStore` during every forward of the model (hooks on the
  model's own forward, so ``model(...)``, a DeepSpeed engine around it and the HF Trainer all take it).
- ``auto``: each block in its own mode (keep; nvme, which here stores everything the block saves and
  recomputes nothing; or recompute), planned by :mod:`aidaptiv_ds.activations.plan` from what the first
  training forward measures (:class:`AutoPolicy`). Every model with a block list, Hugging Face's included,
  gets its blocks' forwards wrapped (HF's own checkpointing, all or nothing, is switched off).

Non-reentrant checkpointing works with ZeRO-3 (the recomputed block calls its modules again, so their
partitioned parameters are gathered by ZeRO-3's own hooks) and on CPU and CUDA alike. Nothing here imports
DeepSpeed; :mod:`aidaptiv_ds.zero3.activations` decides when and with which store this runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from aidaptiv_ds.activations import chunked_loss
from aidaptiv_ds.activations import plan as activation_plan
from aidaptiv_ds.activations.plan import BlockCost
from aidaptiv_ds.activations.store import ActivationStore
from aidaptiv_ds.common.sizes import GiB
from aidaptiv_ds.config.settings import ActivationSettings

log = logging.getLogger(__name__)


def _block_list(model: nn.Module):
    """The largest ModuleList of two or more blocks of one class that hold parameters."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            size = sum(int(getattr(p, "ds_numel", p.numel())) for p in m.parameters())
            if size > 0 and (best is None or size > best[2]):
                best = (name, m, size)
    return None if best is None else best[:2]


def enable_recompute(model: nn.Module) -> str:
    """Make every transformer block of ``model`` a non-reentrant checkpoint; returns how it was done.
    Raises ValueError for a model without blocks to checkpoint."""
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
        # transformers 5 renamed gradient_checkpointing_enable (kept, deprecated) to activation_checkpointing_enable.
        if hasattr(model, "activation_checkpointing_enable"):
            enable = model.activation_checkpointing_enable
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            enable = model.gradient_checkpointing_enable
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "config") and getattr(model.config, "use_cache", False):
            model.config.use_cache = False  # a KV cache would keep every block's keys and values
        return f"{enable.__name__}(use_reentrant=False)"
    found = _block_list(model)
    if found is None:
        raise ValueError(
            f"aidaptiv.activations.policy needs transformer blocks to checkpoint but "
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks: set the policy to "
            '"keep", or enable checkpointing in the model yourself'
        )
    name, blocks = found
    for block in blocks:
        if getattr(block, "_aidaptiv_checkpointed", False):
            continue
        original = block.forward

        @functools.wraps(original)
        def forward(*args, _original=original, _block=block, **kwargs):
            if not (_block.training and torch.is_grad_enabled()):
                return _original(*args, **kwargs)
            return checkpoint(_original, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._aidaptiv_checkpointed = True
    return f"each of {name or 'the model'}'s {len(blocks)} blocks wrapped in torch.utils.checkpoint"


def attach_store(model: nn.Module, store: ActivationStore) -> None:
    """Run every forward of ``model`` under ``store``'s saved-tensor hooks; when it ends, start reading back
    what the backward needs first."""
    active = []

    def enter(module, args):
        if torch.is_grad_enabled():
            ctx = store.hooks()
            ctx.__enter__()
            active.append(ctx)

    def leave(module, args, output):
        if active:
            active.pop().__exit__(None, None, None)
            store.prefetch_last()

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    model._aidaptiv_activation_store = store


# ------------------------------------------------------------------------------------------------ auto


def _is_activation(t) -> bool:
    """A saved tensor that is an activation: not a weight (or a view of one), not a leaf autograd needs."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_sparse:
        return False
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
        return False
    return not (t.requires_grad and t.is_leaf)


class SavedBytes:
    """Saved-tensor hooks that measure what a forward saves and leave every tensor where autograd keeps it:
    the memory its activations hold (distinct storages), what a store would write (every tensor it takes,
    repeats included, as the store copies each one) and what a store would leave in memory."""

    def __init__(self, worth_storing: Callable[[torch.Tensor], bool]):
        self.worth_storing = worth_storing
        self.held: Dict[tuple, int] = {}
        self.left: Dict[tuple, int] = {}
        self.stored = 0

    def pack(self, t):
        if _is_activation(t):
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            self.held[key] = storage.nbytes()
            if self.worth_storing(t):
                self.stored += t.numel() * t.element_size()
            else:
                self.left[key] = storage.nbytes()
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def default_budget(device: torch.device, host_budget: Optional[int]) -> Tuple[int, str]:
    """The activation budget when ``activations.budget`` is "auto": on CUDA half the GPU memory free now (the
    rest for the backward's gradients, a recomputed block and the loss chunks), on CPU this rank's host
    budget (the activations live in ordinary memory beside the swapper's pinned pool)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        free += torch.cuda.memory_reserved(device) - allocated  # cached, unused
        # mem_get_info is the device's; a cap set with set_per_process_memory_fraction (train's
        # --gpu-mem-cap-gb, emulating a smaller card) is the allocator's, and only it tells what is left.
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
        fraction = get_fraction(device) if get_fraction is not None else 1.0
        where = "GPU memory free"
        if fraction < 1.0 and int(fraction * total) - allocated < free:
            free, where = max(0, int(fraction * total) - allocated), "GPU memory left under this process's cap"
        return free // 2, f"half of the {free / GiB:.2f} GiB {where} when planned"
    if host_budget is None:
        raise ValueError(
            'aidaptiv.activations.budget "auto" on CPU is this rank\'s host budget, which this run '
            "does not have: give activations.budget in bytes"
        )
    return host_budget, "this rank's host_memory_budget"


@contextlib.contextmanager
def _outputs_not_recorded():
    """The measuring run of a block records none of its modules' outputs. transformers 5 collects some outputs of a
    forward (a mixture of experts' router logits, attentions, hidden states) by forward hooks on the modules that
    make them, into a collector the model's forward holds: the measuring run, whose result is dropped, would add
    its own, and a mixture's load-balancing loss would then count each router twice, once with a graph whose
    parameters ZeRO-3 has released since (its backward failed: "size mismatch ... vec (0)")."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another version of transformers, or none: nothing collects outputs this way
        yield
        return
    token = _active_collector.set(None)
    try:
        yield
    finally:
        _active_collector.reset(token)


def _share_from_rank0(obj):
    """Every rank takes rank 0's plan: ZeRO-3 gathers parameters collectively, so all ranks must run (and
    recompute) the same blocks in the same order."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class AutoPolicy:
    """The ``auto`` policy on one model: every block's forward goes through :meth:`_forward`, which runs it
    in the block's mode. Until the plan exists the mode is "measure": the block runs once under
    :class:`SavedBytes` (its result dropped), then as a checkpoint (what the step uses, so the first step
    holds no more than ``recompute`` would); the faster of the two runs is the block's forward time (the
    other includes the first fetch of its parameters). When that first training forward ends the plan is
    made (rank 0's, shared), logged once, and applies from the next forward on."""

    def __init__(
        self,
        model: nn.Module,
        blocks: nn.ModuleList,
        store: ActivationStore,
        settings: ActivationSettings,
        bandwidth: Callable[[], Tuple[float, float, str]],
        host_budget: Optional[int] = None,
        rank: int = 0,
    ):
        self.blocks = blocks
        self.store = store
        self.settings = settings
        self.bandwidth = bandwidth
        self.host_budget = host_budget
        self.rank = rank
        self.modes: List[str] = ["measure"] * len(blocks)
        self.costs: Dict[int, BlockCost] = {}
        self.device: Optional[torch.device] = None
        self.summary: Optional[dict] = None
        for i, block in enumerate(blocks):
            original = block.forward

            @functools.wraps(original)
            def forward(*args, _i=i, _original=original, _block=block, **kwargs):
                if not (_block.training and torch.is_grad_enabled()):
                    return _original(*args, **kwargs)
                return self._forward(_i, _original, args, kwargs)

            block.forward = forward
            block._aidaptiv_checkpointed = True
        model.register_forward_hook(self._after_forward, always_call=True)

    def _forward(self, i: int, original, args, kwargs):
        mode = self.modes[i]
        if mode == "keep":
            return original(*args, **kwargs)
        if mode == "recompute":
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
        if mode == "nvme":
            with self.store.hooks():
                return original(*args, **kwargs)
        return self._measure(i, original, args, kwargs)

    def _measure(self, i: int, original, args, kwargs):
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        device = inputs[0].device if inputs else None
        self.device = self.device or device
        saved = SavedBytes(self.store.worth_storing)
        _sync(device)
        t0 = time.perf_counter()
        with saved.hooks(), _outputs_not_recorded():
            out = original(*args, **kwargs)
        _sync(device)
        t1 = time.perf_counter()
        del out  # its graph and saved tensors go with it
        out = checkpoint(original, *args, use_reentrant=False, **kwargs)
        _sync(device)
        t2 = time.perf_counter()
        self.costs[i] = BlockCost(
            index=i,
            forward_s=min(t1 - t0, t2 - t1),
            saved_bytes=sum(saved.held.values()),
            stored_bytes=saved.stored,
            left_bytes=sum(saved.left.values()),
            input_bytes=sum(a.untyped_storage().nbytes() for a in inputs),
        )
        return out

    def _after_forward(self, module, args, output):
        if self.summary is None and self.costs:
            self._plan()
        if "nvme" in self.modes and torch.is_grad_enabled():
            self.store.prefetch_last()

    def _plan(self) -> None:
        summary = None
        if self.rank == 0:
            costs = [self.costs[i] for i in sorted(self.costs)]
            if self.settings.budget is not None:
                budget, source = self.settings.budget, "activations.budget"
            else:
                budget, source = default_budget(self.device or torch.device("cpu"), self.host_budget)
            read, write, how = self.bandwidth()
            plan = activation_plan.plan_blocks(costs, budget, read, write)
            unmeasured = [i for i in range(len(self.blocks)) if i not in self.costs]
            summary = activation_plan.summary(costs, plan, budget, source, read, write, how, unmeasured)
        summary = _share_from_rank0(summary)
        modes = {b["block"]: b["mode"] for b in summary["blocks"]}
        self.modes = [modes.get(i, "recompute") for i in range(len(self.blocks))]
        self.summary = summary
        if self.rank == 0:
            log.info("aidaptiv: %s", activation_plan.render(summary))


def apply(
    model: nn.Module,
    settings: ActivationSettings,
    make_store: Optional[Callable[[], ActivationStore]] = None,
    rank: int = 0,
    bandwidth: Optional[Callable[[], Tuple[float, float, str]]] = None,
    host_budget: Optional[int] = None,
) -> dict:
    """Apply ``settings`` to ``model``; ``make_store`` gives the store for the nvme and auto policies;
    ``bandwidth`` (auto, when ``settings.nvme_bandwidth`` is "auto") gives the swap disk's (read, write)
    bytes/s and where they come from; ``host_budget`` is the CPU default of the auto budget. Returns what
    was done (the plan the metrics report; auto's per-block plan joins it as ``"plan"`` once made)."""
    plan = {"policy": settings.policy, "loss_chunk_tokens": None, "recompute": None, "stored": False}
    if settings.loss_chunk_tokens:
        reason = chunked_loss.unsupported_reason(model)
        if reason is None:
            chunked_loss.install(model, settings.loss_chunk_tokens)
            plan["loss_chunk_tokens"] = settings.loss_chunk_tokens
        elif rank == 0:
            log.warning("aidaptiv: the loss is not chunked: %s", reason)
    if settings.policy == "keep":
        return plan
    if settings.policy == "auto":
        return _apply_auto(model, settings, make_store, rank, bandwidth, host_budget, plan)
    if settings.policy not in ("recompute", "nvme"):
        raise ValueError(f"aidaptiv.activations.policy {settings.policy!r}: expected keep, recompute, nvme or auto")
    plan["recompute"] = enable_recompute(model)
    if settings.policy == "nvme":
        if make_store is None:
            raise ValueError(
                'aidaptiv.activations.policy "nvme" needs the aidaptiv swap space, which this run '
                'does not have: enable the aidaptiv block or choose "recompute"'
            )
        attach_store(model, make_store())
        plan["stored"] = True
    if rank == 0:
        log.info(
            "aidaptiv: activations %s (%s)%s",
            settings.policy,
            plan["recompute"],
            f", loss in chunks of {plan['loss_chunk_tokens']} tokens" if plan["loss_chunk_tokens"] else "",
        )
    return plan


def _apply_auto(model, settings, make_store, rank, bandwidth, host_budget, plan) -> dict:
    problems = []
    found = _block_list(model)
    if found is None:
        problems.append(
            f'aidaptiv.activations.policy "auto" plans per transformer block but '
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks: set the policy to "
            '"keep" or "recompute"'
        )
    elif any(getattr(b, "_aidaptiv_checkpointed", False) for b in found[1]):
        problems.append('aidaptiv.activations.policy "auto": the blocks already run under another policy')
    if make_store is None:
        problems.append(
            'aidaptiv.activations.policy "auto" may store blocks on NVMe, which needs the aidaptiv '
            'swap space this run does not have: enable the aidaptiv block or choose "recompute"'
        )
    if settings.nvme_bandwidth is None and bandwidth is None:
        problems.append(
            'aidaptiv.activations.nvme_bandwidth "auto" needs a measured rate, which this run '
            "cannot get: give it in bytes/s"
        )
    if problems:
        raise ValueError("; ".join(problems))
    # transformers 5 renamed is_gradient_checkpointing and gradient_checkpointing_disable (kept, deprecated).
    new = hasattr(model, "activation_checkpointing_disable")
    on = getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False)
    if on:
        # The plan decides which blocks are checkpointed; Hugging Face's own would checkpoint all of them again.
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
        if rank == 0:
            log.info("aidaptiv: the model's own gradient checkpointing is off: the auto policy plans it per block")
    if hasattr(model, "config") and getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a KV cache would keep every block's keys and values
    if settings.nvme_bandwidth is not None:
        given = settings.nvme_bandwidth
        bandwidth = lambda: (given, given, "activations.nvme_bandwidth")  # noqa: E731
    name, blocks = found
    policy = AutoPolicy(model, blocks, make_store(), settings, bandwidth, host_budget=host_budget, rank=rank)
    plan["recompute"] = f"planned per block of {name or 'the model'}'s {len(blocks)} from the first training forward"
    plan["stored"] = True
    model._aidaptiv_auto_policy = policy
    if rank == 0:
        log.info(
            "aidaptiv: activations auto: the first training forward measures each of the %d blocks, then "
            "the plan is made%s",
            len(blocks),
            f"; loss in chunks of {plan['loss_chunk_tokens']} tokens" if plan["loss_chunk_tokens"] else "",
        )
    return plan


def auto_plan(model: nn.Module) -> Optional[dict]:
    """The auto policy's plan of ``model`` (:func:`aidaptiv_ds.activations.plan.summary`), once made."""
    policy = getattr(model, "_aidaptiv_auto_policy", None)
    return None if policy is None else policy.summary
