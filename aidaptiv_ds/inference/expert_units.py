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
  at the range's offset past its page. Possible when the file holds the weights in the dtype generated in; an
  expert's slice of a parameter is at best one run of bytes (a fused tensor's slice; or, for per-expert tensors,
  gate and up adjacent, as safetensors orders names). One view of the slots serves every expert: where an expert
  lies otherwise against the pages than most (its layer straddles two shards, whose headers differ in length) or
  its slice is in pieces (a shard's end cuts it), its parameters are moved to the views' places in its slot once
  read. Not possible where those places would overlap (Mixtral's w1, w2, w3: down between gate and up);
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
Move = Tuple[int, int, int]  # (from, to, bytes) within a slot


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
    moves_in_place: Optional[List[Optional[List[Move]]]] = None  # per expert: None, or its parameters' moves
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
        self.span = max(
            max(sum(n for _, _, n, _ in reads) for reads in self.reads_in_place),
            align_up(max(self.offsets_in_place[p.attr] + p.nbytes for p in self.params), ALIGN),
        )

    def moves(self, expert: int) -> Optional[List[Move]]:
        """What to move within the slot once ``expert`` is read, for its parameters to lie where the views see
        them (None: nothing)."""
        return self.moves_in_place[expert] if self.in_place else None

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


def _file_runs(source: WeightSource, name: str, start: int, nbytes: int) -> List[Tuple[str, int, int, int]]:
    """Bytes ``start`` .. ``start + nbytes`` of tensor ``name`` as runs of the files: (file, offset, bytes, place
    in those bytes), adjacent pieces of one file joined."""
    runs: list = []
    pos = 0
    for path, offset, n in source.tensors[name].pieces:
        lo, hi = max(start, pos), min(start + nbytes, pos + n)
        if lo < hi:
            at = offset + lo - pos
            if runs and runs[-1][0] == path and runs[-1][1] + runs[-1][2] == at:
                runs[-1][2] += hi - lo
            else:
                runs.append([path, at, hi - lo, lo - start])
        pos += n
    return [tuple(r) for r in runs]


def _plan_in_place(s: ExpertSet, source: WeightSource) -> None:
    """Set ``s.reads_in_place`` when the experts of ``s`` can be read from the model's files: each expert's
    runs of bytes (a parameter's slice is one run, or a few: gate and up of per-expert tensors, each its own
    tensor) read as the 4 KiB aligned ranges around them, runs that share or touch a page in one read (a
    checkpoint with one tensor per expert keeps an expert's tensors side by side: one read an expert).

    One view of the slots serves every expert, so a parameter must lie at the same place in every slot. Experts
    lie the same way against the pages within one file, but a layer whose experts straddle two shards lies one
    way in each (the shards' headers differ in length), and an expert cut by a shard's end lies in two files:
    the places most experts' parameters land at, whole, are the views' places, and the runs of an expert that
    land elsewhere are moved there in its slot once read (``moves_in_place``, in an order in which no move
    overwrites bytes another has still to move), not copied into the swap file."""
    if source.kind != "hf":
        return  # our checkpoints' params.bin: a tensor's bytes are pieces of several ranks' files
    if any(source.tensors[p.name].dtype != p.dtype for p in s.params):
        return  # converted to another dtype: only the swap file holds the converted bytes
    reads, lands = [], []  # per expert: its reads; where each run of each parameter lands in the slot
    for e in range(s.num_experts):
        runs = []  # (file, offset, bytes, parameter, place in the parameter's slice)
        for p in s.params:
            runs += [(path, o, n, p, at) for path, o, n, at in _file_runs(source, p.name, e * p.nbytes, p.nbytes)]
        runs.sort(key=lambda r: (r[0], r[1]))
        mine, land, place = [], {}, 0
        i = 0
        while i < len(runs):
            path, offset, n, p, at = runs[i]
            first, end, members = offset // ALIGN * ALIGN, offset + n, [runs[i]]
            while i + 1 < len(runs) and runs[i + 1][0] == path and runs[i + 1][1] <= align_up(end):
                i += 1
                members.append(runs[i])
                end = max(end, runs[i][1] + runs[i][2])
            length = align_up(end) - first
            mine.append((path, first, length, place))
            for _, o, n, q, at in members:
                land[(q.attr, at)] = (place + o - first, n)
            place += length
            i += 1
        reads.append(mine)
        lands.append(land)
    reference = _reference_places(s, lands)
    if reference is None:
        return
    moves = []
    for land in lands:
        wanted = [(src, reference[attr] + at, n) for (attr, at), (src, n) in sorted(land.items())]
        order = _move_order([m for m in wanted if m[0] != m[1]])
        if order is None:
            return  # the moves overwrite one another whatever their order: the swap file
        moves.append(order or None)
    s.reads_in_place, s.offsets_in_place, s.moves_in_place = reads, reference, moves


def _reference_places(s: ExpertSet, lands: List[dict]) -> Optional[Dict[str, int]]:
    """Where each parameter lies in every slot: where most experts' runs land with each parameter whole (its runs
    one after another), the first such expert's among equals; else where the first expert's parameters begin.
    None when those places overlap or cannot be viewed (not on an element of the parameter's dtype)."""
    candidates = []
    for land in lands:
        starts = {attr: place for (attr, at), (place, _) in land.items() if at == 0}
        if all(starts[attr] + at == place for (attr, at), (place, _) in land.items()):
            candidates.append(tuple(sorted(starts.items())))
    if candidates:
        reference = dict(max(candidates, key=lambda k: (candidates.count(k), -candidates.index(k))))
    else:
        reference = {attr: place for (attr, at), (place, _) in lands[0].items() if at == 0}
    spans = sorted((reference[p.attr], reference[p.attr] + p.nbytes) for p in s.params)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    if any(reference[p.attr] % p.dtype.itemsize for p in s.params):
        return None
    return reference


def _move_order(moves: List[Move]) -> Optional[List[Move]]:
    """``moves`` (source, destination, bytes within a slot) in an order where none writes over the source of one
    still to come (each move itself may overlap its own source: a memmove), or None when there is none."""
    pending, order = list(moves), []
    while pending:
        for k, (src, dst, n) in enumerate(pending):
            if not any(dst < s2 + n2 and s2 < dst + n for j, (s2, _, n2) in enumerate(pending) if j != k):
                order.append(pending.pop(k))
                break
        else:
            return None
    return order
