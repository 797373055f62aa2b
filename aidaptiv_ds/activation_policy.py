"""Apply an activation policy (``aidaptiv.activations``) to a model: keep, recompute, or store on NVMe; and
the chunked loss.

- ``keep``: the model as it is.
- ``recompute``: every transformer block is a checkpoint (``torch.utils.checkpoint`` without re-entry):
  the forward keeps only each block's input, and the backward runs the block again. Hugging Face models
  get their own ``gradient_checkpointing_enable(use_reentrant=False)``; other models with a list of blocks
  (:func:`aidaptiv_ds.zero3.layer_groups.find_block_list`'s rule, repeated here without DeepSpeed) get each
  block's forward wrapped.
- ``nvme``: ``recompute``, and the tensors those checkpoints keep go to an
  :class:`aidaptiv_ds.activation_store.ActivationStore` during every forward of the model (hooks on the
  model's own forward, so ``model(...)``, a DeepSpeed engine around it and the HF Trainer all take it).

Non-reentrant checkpointing works with ZeRO-3 (the recomputed block calls its modules again, so their
partitioned parameters are gathered by ZeRO-3's own hooks) and on CPU and CUDA alike. Nothing here imports
DeepSpeed; :mod:`aidaptiv_ds.zero3.activations` decides when and with which store this runs.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from aidaptiv_ds import chunked_loss
from aidaptiv_ds.activation_store import ActivationStore
from aidaptiv_ds.config import ActivationSettings

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
            model.config.use_cache = False       # a KV cache would keep every block's keys and values
        return f"{enable.__name__}(use_reentrant=False)"
    found = _block_list(model)
    if found is None:
        raise ValueError(f"aidaptiv.activations.policy needs transformer blocks to checkpoint but "
                         f"{type(model).__name__} has no nn.ModuleList of repeated blocks: set the policy to "
                         "\"keep\", or enable checkpointing in the model yourself")
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


def apply(model: nn.Module, settings: ActivationSettings,
          make_store: Optional[Callable[[], ActivationStore]] = None, rank: int = 0) -> dict:
    """Apply ``settings`` to ``model``; ``make_store`` gives the store for the nvme policy. Returns what was
    done (the plan the metrics report)."""
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
    if settings.policy not in ("recompute", "nvme"):
        raise ValueError(f"aidaptiv.activations.policy {settings.policy!r}: expected keep, recompute or nvme")
    plan["recompute"] = enable_recompute(model)
    if settings.policy == "nvme":
        if make_store is None:
            raise ValueError("aidaptiv.activations.policy \"nvme\" needs the aidaptiv swap space, which this run "
                             "does not have: enable the aidaptiv block or choose \"recompute\"")
        attach_store(model, make_store())
        plan["stored"] = True
    if rank == 0:
        log.info("aidaptiv: activations %s (%s)%s", settings.policy, plan["recompute"],
                 f", loss in chunks of {plan['loss_chunk_tokens']} tokens" if plan["loss_chunk_tokens"] else "")
    return plan
