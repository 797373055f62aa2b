"""The tensors of a weight source under the names of the model built from its config, as transformers 5 maps a
checkpoint's keys when it loads one, described as pieces of the same files: nothing is converted or copied.

Transformers 5 keeps the experts of a mixture-of-experts layer in fused 3D parameters
(``mlp.experts.gate_up_proj`` [experts, 2 x intermediate, hidden], ``mlp.experts.down_proj``), while the
checkpoints on the hub, and what its own ``save_pretrained`` writes for OLMoE, Qwen3-MoE and Mixtral, hold one
tensor per expert and projection (``mlp.experts.3.gate_proj.weight``; Mixtral's under another module name,
``block_sparse_moe.experts.3.w1.weight``). At load time transformers renames the keys and stacks and
concatenates the experts' tensors (its conversion mapping: ``WeightRenaming``, and ``WeightConverter`` with
``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)``). Stacking along a new first dimension and then
concatenating along the next one lays out, for each expert in turn, its first source tensor's bytes then its
second's: so the fused parameter's bytes are exactly those source tensors' bytes in that order, and it is one
:class:`~aidaptiv_ds.inference.sources.TensorEntry` of their pieces. Reading expert e's range of it reads those
tensors from the files, which is what lets generation read a routed expert straight from the model's files.

Other conversions (quantized experts, interleaving, fused attention split in pieces) are not byte-for-byte
rearrangements of this kind: a source that needs one is refused, naming the tensors.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from aidaptiv_ds.inference.sources import ModelSourceError, TensorEntry, WeightSource


def _merge_then_concat(converter) -> bool:
    """Whether ``converter``'s operations are MergeModulelist(dim=0), optionally then Concatenate(dim=1): the
    conversions whose result is the source tensors' bytes in order."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return False
    if len(ops) == 1:
        return len(converter.source_patterns) == 1
    return len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim == 1


def with_model_names(source: WeightSource, model: torch.nn.Module) -> WeightSource:
    """``source`` with its tensors named as ``model``'s parameters (``source`` itself when they already are)."""
    wanted = dict(model.named_parameters())
    if all(name in source.tensors for name in wanted):
        return source
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # a transformers without conversion mappings: names are taken as they are
        return source
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    tensors: Dict[str, TensorEntry] = {}
    collected: Dict[str, Dict[str, List[TensorEntry]]] = {}  # target -> source pattern -> entries, expert order
    converter_of = {}
    for key in sorted(source.tensors, key=dot_natural_key):  # transformers' order: experts by number
        entry = source.tensors[key]
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:
            target, pattern = key, None
        if target not in meta:
            tensors[key] = entry  # not the model's: bind_sources reports it with the others
        elif pattern is None:
            tensors[target] = TensorEntry(target, entry.shape, entry.dtype, entry.pieces)
        else:
            collected.setdefault(target, {}).setdefault(pattern, []).append(entry)
            converter_of[target] = by_pattern[pattern]
    for target, lists in collected.items():
        converter = converter_of[target]
        names = [e.name for entries in lists.values() for e in entries[:1]]
        if not _merge_then_concat(converter):
            ops = ", ".join(type(op).__name__ for op in converter.operations)
            raise ModelSourceError(
                f"{source.path}: tensors {', '.join(names)}, ... reach the model's {target} through transformers' "
                f"conversion ({ops}), which generate does not read: convert the checkpoint to the model's own "
                "tensor names (load it with transformers and save its state_dict with safetensors) first"
            )
        ordered = [lists[p] for p in converter.source_patterns if p in lists]
        counts = {len(entries) for entries in ordered}
        each = [{e.shape for e in entries} for entries in ordered]  # every expert's tensor alike
        tails = {next(iter(s))[1:] for s in each}  # and the sources alike past the rows they concatenate
        dtypes = {e.dtype for entries in ordered for e in entries}
        if len(counts) != 1 or any(len(s) != 1 for s in each) or len(tails) != 1 or len(dtypes) != 1:
            raise ModelSourceError(
                f"{source.path}: the tensors transformers fuses into {target} ({', '.join(names)}, ...) do not "
                "agree in count, shape or dtype: the checkpoint is damaged or of another model"
            )
        experts = counts.pop()
        first = [entries[0].shape for entries in ordered]
        # Stacked: [experts, *shape]; then concatenated along dim 1: the rows of each source add up.
        shape = (experts, sum(s[0] for s in first), *first[0][1:])
        pieces = tuple(p for e in range(experts) for entries in ordered for p in entries[e].pieces)
        tensors[target] = TensorEntry(target, shape, dtypes.pop(), pieces)
    return WeightSource(source.kind, source.path, source.files_dir, tensors, source.identity)
