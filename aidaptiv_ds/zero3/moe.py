"""Mixture-of-experts blocks made ZeRO-3 leaf modules, so that ranks which route their tokens to different experts
make the same collectives in the same order.

ZeRO-3 gathers a module's parameters when the module is about to run (a forward pre-hook on every module) and
reduce-scatters each gradient from a hook on its parameter; both are collectives every rank must enter in
the same order, and DeepSpeed 0.19.8 also checks that the ranks agree on what they fetched. With per-expert
modules (a ModuleList of experts, transformers 4's layout and that of models written by hand) only the experts
a rank's tokens chose run on that rank: with two ranks routed to disjoint halves of the experts, 0.19.8 stops
in its second step ("Detected a disagreement on list contents between rank0 and rank1", seen with
tests/integration/moe_disjoint_run.py and DeepSpeed's default leaf classes off), and where the lists happened to
agree in length the ranks would wait on each other's collectives instead. transformers 5.23 keeps every expert of
a layer in one ``experts`` module (fused 3D parameters) that every rank enters with whatever tokens it has, so
its modules run alike on every rank; the leaves cost its families nothing (below).

DeepSpeed's answer is ``deepspeed.utils.set_z3_leaf_modules``: a leaf's parameters, its children's included,
are gathered together when the leaf is entered, its children get no hooks, and its gradients are
reduce-scattered together when the leaf's backward is done, an expert that got no token giving zeros
(stage3.py's ``reduce_leaf_module_grads``). Every rank then makes the same calls whatever its router chose.
DeepSpeed 0.19.8 makes three block classes leaves by default (``zero_optimization.leaf_module``: Mixtral's,
Qwen2-MoE's and Qwen3-MoE's); gpt-oss's ``GptOssMLP`` and OLMoE's ``OlmoeSparseMoeBlock`` are not among them,
nor is any block of a model written by hand. :func:`mark_moe_blocks` finds the blocks by their structure
instead of their class names and makes them all leaves: one rule for every layout, so a model of per-expert
modules given to ``deepspeed.initialize`` with an aidaptiv block trains as a fused one does. For the fused
layout it changes no number: the block's parameters are gathered once instead of twice (router, then
experts), and the gradients are the same.

The alternative the issue names, each layer's experts as whole layer groups of our swapper, is what the swapper
does anyway (a layer group is one or more whole decoder layers, so a layer's experts are read and written
together); it decides what is read from NVMe, not which collectives DeepSpeed makes, so it cannot prevent the
hang by itself.
"""

from __future__ import annotations

import logging
from typing import List

import torch.nn as nn

log = logging.getLogger(__name__)


def _holds_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds a mixture's experts: fused 3D parameters of its own (transformers 5: one row per
    expert), or a ModuleList of two or more expert modules of one class (per-expert layouts)."""
    # ZeRO-3 partitions a parameter in place: its shape is then ds_shape, the tensor a 1-D partition.
    if any(len(getattr(p, "ds_shape", p.shape)) == 3 for p in module.parameters(recurse=False)):
        return True
    return isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1


def moe_blocks(model: nn.Module) -> List[str]:
    """Names (``named_modules``) of the MoE blocks of ``model``: each module with a child called ``experts`` that
    holds experts (:func:`_holds_experts`), i.e. the block that owns the router, the experts and any shared
    expert; outermost first, none nested in another."""
    found: List[str] = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or experts not in list(module.children()):
            continue
        if not _holds_experts(experts):
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue
        found.append(name)
    return found


def mark_moe_blocks(model: nn.Module) -> List[str]:
    """Make every MoE block of ``model`` a ZeRO-3 leaf module (idempotent); returns their names. Call it before
    ``deepspeed.initialize``, which installs ZeRO-3's hooks by the flags set here."""
    from deepspeed.utils import set_z3_leaf_modules_by_name

    names = moe_blocks(model)
    if names:
        set_z3_leaf_modules_by_name(model, names, flag=True, raise_if_not_found=True)
        log.info("aidaptiv: %d mixture-of-experts blocks made ZeRO-3 leaf modules (%s, ...)", len(names), names[0])
    return names
