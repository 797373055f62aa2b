"""Cut a model's parameters into layer groups: the unit that is read, prefetched and cached together.

A transformer's blocks sit in one ``nn.ModuleList`` (``model.layers`` in Hugging Face Llama/Qwen,
``transformer.h`` in GPT-2). Groups are ``layer_group_size`` consecutive blocks; the parameters used before
the blocks (embeddings) form one group and those after them (final norm, LM head) another, so a group
matches a contiguous stretch of the forward pass. Models without such a list are cut by size instead.
Parameters are taken in ``named_parameters`` order, which for these models is the order they run in.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch.nn as nn

# Models without a block list are cut into this many groups of about equal size.
FALLBACK_GROUPS = 8


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def find_block_list(module: nn.Module) -> Optional[Tuple[str, nn.ModuleList]]:
    """The largest ModuleList of two or more blocks of one class that hold parameters."""
    best = None
    for name, m in module.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        if len({type(c) for c in m}) != 1:
            continue
        size = sum(_numel(p) for p in m.parameters())
        if size > 0 and (best is None or size > best[2]):
            best = (name, m, size)
    return None if best is None else (best[0], best[1])


def partition_into_groups(module: nn.Module, layer_group_size: int) -> List[Tuple[str, list]]:
    """Return ``[(group name, [parameters in forward order]), ...]`` covering every parameter once."""
    params = [p for _, p in module.named_parameters()]
    found = find_block_list(module)
    if found is None:
        return _by_size(params)
    list_name, blocks = found
    block_of = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            block_of.setdefault(id(p), i)
    groups: List[Tuple[str, list]] = []
    before, after = [], []
    by_group = {}
    last_in_block = max(k for k, p in enumerate(params) if id(p) in block_of)
    current = None
    for k, p in enumerate(params):
        i = block_of.get(id(p))
        if i is None:
            if current is None:
                before.append(p)
            elif k < last_in_block:
                by_group[current].append(p)  # between blocks: travels with the preceding group
            else:
                after.append(p)
            continue
        current = i // layer_group_size
        by_group.setdefault(current, []).append(p)
    if before:
        groups.append(("before " + list_name, before))
    n = len(blocks)
    for gi in sorted(by_group):
        lo, hi = gi * layer_group_size, min(n, (gi + 1) * layer_group_size) - 1
        groups.append((f"{list_name}[{lo}]" if lo == hi else f"{list_name}[{lo}-{hi}]", by_group[gi]))
    if after:
        groups.append(("after " + list_name, after))
    return groups


def _by_size(params: list) -> List[Tuple[str, list]]:
    total = sum(_numel(p) for p in params)
    target = max(1, total // FALLBACK_GROUPS)
    groups, cur, size = [], [], 0
    for p in params:
        cur.append(p)
        size += _numel(p)
        if size >= target:
            groups.append((f"chunk {len(groups)}", cur))
            cur, size = [], 0
    if cur:
        groups.append((f"chunk {len(groups)}", cur))
    return groups
