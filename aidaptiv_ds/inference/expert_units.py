"""The routed experts of a mixture-of-experts model as units of their own: which modules hold them, what one
expert's bytes are, and where they are read from (the model's own safetensors files, or the swap file).

Transformers 5 keeps a layer's experts in one module (``OlmoeExperts``, ``Qwen3MoeExperts``, ``MixtralExperts``,
``GptOssExperts``, ...; the classes its ``use_experts_implementation`` decorator wraps) whose parameters are 3D
tensors, one slice per expert along their first dimension (``gate_up_proj`` [experts, 2 x intermediate,
hidden], ``down_proj``, and gpt-oss's biases). Its forward takes ``(hidden_states, top_k_index,
top_k_weights)`` from the router and, in the implementations transformers chooses by default ("grouped_mm") or
offers ("batched_mm"), computes each token's output from the rows of its own experts and sums a token's experts
in the order of its top-k slots, whatever the experts' numbers: so the experts may sit at any positions of the
parameters as long as ``top_k_index`` is renumbered to match, and the tokens come out bit for bit the same
(:mod:`.expert_cache` relies on this). An experts module of another implementation (eager loops over the
experts in number order and sums in that order), one with a submodule of its own (a norm after the experts) or
one whose parameters are not one slice per expert stays inside its layer, streamed with it.

An :class:`ExpertSet` is one such module: its parameters' per-expert shapes and the place of each in a slot of
the expert cache. Its experts are read one of two ways:

- **in place**, from the model's safetensors files: one read per parameter and expert, of the 4 KiB aligned
  range around that expert's bytes (O_DIRECT moves whole pages), into the slot; the parameter lies in the slot
  at the range's offset past its page. Possible when the file holds the weights in the dtype generated in, each
  expert's slice of a parameter is one run of bytes of one file (a fused tensor's slice; or, for per-expert
  tensors, gate and up adjacent, as safetensors orders names), and every expert of the set lies the same way
  against the pages (same offsets past their pages, same lengths), so one view of the slots serves all;
- **from the swap file**, where the lay-out writes the set's experts one after another, each one 4 KiB aligned
  unit of all its parameters: one read per expert, and a layer's experts in one extent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from aidaptiv_ds.common.sizes import ALIGN, align_up
from aidaptiv_ds.inference.sources import WeightSource
from aidaptiv_ds.inference.weight_groups import TENSOR_ALIGN

# Implementations whose result does not depend on where each expert sits in the parameters (see above).
ORDER_FREE = ("grouped_mm", "batched_mm")

Read = Tuple[Optional[str], int, int, int]  # (model file, or None: the swap file; offset; bytes; place in the slot)


@dataclass(eq=False)
class ExpertParam:
    """One parameter of an experts module, as one expert's slice of it."""

    attr: str
    name: str  # the source tensor (the model's name: :mod:`.checkpoint_names`)
    shape: tuple  # one expert's slice
    dtype: torch.dtype
    nbytes: int  # one expert's slice
    offset: int = 0  # where the slice lies in a slot


@dataclass(eq=False)
class ExpertSet:
    """One module's experts, streamed expert by expert through the expert cache."""

    index: int
    label: str  # the module's name in the model
    module: torch.nn.Module
    num_experts: int
    top_k: int  # experts a token uses (the config's num_experts_per_tok)
    params: List[ExpertParam] = field(default_factory=list)
    unit_bytes: int = 0  # one expert in the swap file: its parameters one after another, 4 KiB aligned
    in_place: bool = False
    span: int = 0  # bytes of a slot one expert takes
    reads_in_place: Optional[List[List[Read]]] = None  # per expert, when it can be read in place
    offsets_in_place: Optional[Dict[str, int]] = None
    extent: object = None  # from the swap file: the set's experts, expert e at e * unit_bytes

    @property
    def expert_nbytes(self) -> int:
        """One expert's weights (what a token that routes to it needs), without alignment."""
        return sum(p.nbytes for p in self.params)

    @property
    def nbytes(self) -> int:
        return self.num_experts * self.expert_nbytes

    def reads(self, expert: int) -> List[Read]:
        """The reads that bring ``expert`` into a slot."""
        if self.in_place:
            return self.reads_in_place[expert]
        return [(None, self.extent.offset + expert * self.unit_bytes, self.unit_bytes, 0)]

    def read_nbytes(self, expert: int) -> int:
        return sum(n for _, _, n, _ in self.reads(expert))

    def use_swap(self) -> None:
        """Read from the swap file: the unit layout (parameters one after another, each on a cache line)."""
        self.in_place = False
        offset = 0
        for p in self.params:
            offset = align_up(offset, TENSOR_ALIGN)
            p.offset = offset
            offset += p.nbytes
        self.unit_bytes = align_up(max(offset, 1), ALIGN)
        self.span = self.unit_bytes

    def use_in_place(self) -> None:
        self.in_place = True
        for p in self.params:
            p.offset = self.offsets_in_place[p.attr]
        self.span = sum(n for _, _, n, _ in self.reads_in_place[0])

    def views(self, pool: torch.Tensor, slot_bytes: int) -> Dict[str, torch.Tensor]:
        """Each parameter as a view of the whole pool of slots, [slots, *one expert's shape]: expert slot s is
        row s (the forward's ``top_k_index`` renumbered to slots)."""
        slots = pool.numel() // slot_bytes
        out = {}
        for p in self.params:
            item = p.dtype.itemsize
            typed = pool.view(p.dtype)
            strides = [1] * len(p.shape)
            for d in range(len(p.shape) - 2, -1, -1):
                strides[d] = strides[d + 1] * p.shape[d + 1]
            out[p.attr] = typed.as_strided((slots, *p.shape), (slot_bytes // item, *strides), p.offset // item)
        return out


def _config_top_k(model: torch.nn.Module, num_experts: int) -> int:
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        k = getattr(c, "num_experts_per_tok", None) if c is not None else None
        if isinstance(k, int) and 0 < k <= num_experts:
            return k
    return num_experts


def routed_modules(model: torch.nn.Module) -> Tuple[List[Tuple[str, torch.nn.Module]], List[str]]:
    """(name, module) of every experts module whose experts can be read as routed, and why others cannot."""
    found, why = [], []
    for name, m in model.named_modules():
        num = getattr(m, "num_experts", None)
        params = list(m.named_parameters(recurse=False))
        if not (hasattr(m, "has_gate") and hasattr(m, "is_transposed") and isinstance(num, int) and params):
            continue  # not an experts module of transformers' decorator
        impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
        if impl not in ORDER_FREE:
            why.append(f"{name}: experts implementation {impl!r} (routed reads need one of {', '.join(ORDER_FREE)})")
        elif any(True for _ in m.children() if any(True for _ in _.parameters())):
            why.append(f"{name}: a submodule with weights of its own inside the experts")
        elif any(p.dim() < 2 or p.shape[0] != num for _, p in params):
            why.append(f"{name}: a parameter that is not one slice per expert")
        else:
            found.append((name, m))
    return found, why


def expert_sets_of(
    model: torch.nn.Module, modules: List[Tuple[str, torch.nn.Module]], source: WeightSource, dtype
) -> List[ExpertSet]:
    """An :class:`ExpertSet` for each module, laid out for the swap file, and for reading in place where the
    source allows it (``reads_in_place``)."""
    sets = []
    for name, m in modules:
        num = int(m.num_experts)
        s = ExpertSet(len(sets), name, m, num, _config_top_k(model, num))
        for attr, p in m.named_parameters(recurse=False):
            entry = source.tensors[f"{name}.{attr}"]
            want = dtype if (dtype is not None and entry.dtype.is_floating_point) else entry.dtype
            shape = tuple(p.shape[1:])
            s.params.append(ExpertParam(attr, entry.name, shape, want, math.prod(shape) * want.itemsize))
        s.use_swap()
        _plan_in_place(s, source)
        sets.append(s)
    return sets


def _file_range(source: WeightSource, name: str, start: int, nbytes: int) -> Optional[Tuple[str, int]]:
    """(file, offset) of bytes ``start`` .. ``start + nbytes`` of tensor ``name`` when they are one run of one
    file, else None."""
    runs: list = []
    pos = 0
    for path, offset, n in source.tensors[name].pieces:
        lo, hi = max(start, pos), min(start + nbytes, pos + n)
        if lo < hi:
            at = offset + lo - pos
            if runs and runs[-1][0] == path and runs[-1][1] + runs[-1][2] == at:
                runs[-1][2] += hi - lo
            else:
                runs.append([path, at, hi - lo])
        pos += n
    return (runs[0][0], runs[0][1]) if len(runs) == 1 else None


def _plan_in_place(s: ExpertSet, source: WeightSource) -> None:
    """Set ``s.reads_in_place`` when every expert of ``s`` can be read from the model's files the same way:
    each parameter's slice one run of one file, runs that share or touch a page read as one (a checkpoint with one
    tensor per expert keeps an expert's tensors side by side: one read an expert)."""
    if source.kind != "hf":
        return  # our checkpoints' params.bin: a tensor's bytes are pieces of several ranks' files
    if any(source.tensors[p.name].dtype != p.dtype for p in s.params):
        return  # converted to another dtype: only the swap file holds the converted bytes
    reads, offsets, signature = [], {}, None
    for e in range(s.num_experts):
        runs = []  # (file, offset, parameter)
        for p in s.params:
            found = _file_range(source, p.name, e * p.nbytes, p.nbytes)
            if found is None or found[1] % p.dtype.itemsize:
                return  # in pieces, or starting inside an element of the view
            runs.append((found[0], found[1], p))
        runs.sort(key=lambda r: (r[0], r[1]))
        mine, at, place = [], {}, 0
        i = 0
        while i < len(runs):
            path, offset, p = runs[i]
            first, end, members = offset // ALIGN * ALIGN, offset + p.nbytes, [(offset, p)]
            while i + 1 < len(runs) and runs[i + 1][0] == path and runs[i + 1][1] <= align_up(end):
                i += 1
                members.append((runs[i][1], runs[i][2]))
                end = max(end, runs[i][1] + runs[i][2].nbytes)
            length = align_up(end) - first
            mine.append((path, first, length, place))
            for o, q in members:
                at[q.attr] = place + o - first
            place += length
            i += 1
        key = ([n for _, _, n, _ in mine], at)
        if signature is None:
            signature, offsets = key, at
        elif key != signature:
            return  # experts lie differently against the pages: no one view of the slots serves them all
        reads.append(mine)
    s.reads_in_place, s.offsets_in_place = reads, offsets
