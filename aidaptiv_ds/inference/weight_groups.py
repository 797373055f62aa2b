"""The parameter groups of a model whose weights are streamed (:mod:`aidaptiv_ds.inference.streamed`): what they
are, how they are found, and where each parameter lies in its group's bytes.

The model is built with empty parameters (``accelerate.init_empty_weights``: no tensor allocated). Its
parameters fall into *groups*: each element of a decoder's layer list is one group (a layer's attention, MLP
and norms), and every other module with parameters of its own (embeddings, final norm, LM head) is a group of
those. Groups run in the model's module order, once per forward pass.

Each parameter is a *member* of its group, matched to the source tensor of its name and placed at an offset of
the group's bytes (every tensor on a cache line); a parameter tied to another is a member that names the one it
shares. A :class:`Slot` is one of the pinned buffers the streamed groups are read into. The two budget errors
say that a budget given cannot hold what streaming needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from aidaptiv_ds.common.sizes import ALIGN, align_up
from aidaptiv_ds.inference.sources import WeightSource
from aidaptiv_ds.inference.weight_codec import Codebook

TENSOR_ALIGN = 64  # every tensor of a group starts on a cache line, whatever the dtype


class HostBudgetTooSmall(ValueError):
    """The host budget cannot hold what generation needs resident plus two streamed slots."""


class DeviceBudgetTooSmall(ValueError):
    """The GPU budget cannot hold what every step uses plus the two slots' GPU twins."""


@dataclass(eq=False)
class Member:
    """One parameter of a group: where it lives in the model, which source tensor fills it, where its bytes lie."""

    module: torch.nn.Module
    attr: str
    name: str  # the source tensor it is read from
    shape: tuple
    dtype: torch.dtype
    offset: int  # in the group's bytes
    nbytes: int
    tied_to: Optional[tuple] = None  # (module, attr) of the parameter this one is tied to (name is "" then)
    book: Optional[Codebook] = None  # encoded in the swap file (weight_codec), or stored as it is
    encoded_offset: int = 0  # in the group's encoded bytes


@dataclass(eq=False)
class Group:
    """A layer of the layer list, or another module's own parameters: resident or streamed as one."""

    index: int
    label: str
    module: torch.nn.Module
    members: List[Member] = field(default_factory=list)
    nbytes: int = 0  # aligned size of the group's bytes
    encoded_nbytes: int = 0  # aligned size of its encoded bytes in the swap file (0: stored as it is)
    is_layer: bool = False
    resident: bool = True  # bound for good, on the device the model computes on
    in_host: bool = False  # CUDA: streamed from pinned host memory (no disk read), not from the swap file
    by_rows: bool = False  # an embedding table in the swap file, its rows read per forward
    row_bytes: int = 0
    buffer: Optional[torch.Tensor] = None  # resident and in-host groups: their bytes
    extent: object = None  # streamed groups and tables read by rows: their extent of the swap file

    @property
    def read_nbytes(self) -> int:
        """Bytes of the group in the swap file: what one read of it brings in."""
        return self.encoded_nbytes or self.nbytes

    def bind(self, buffer: torch.Tensor) -> None:
        """Make the group's parameters views of ``buffer``, which holds the group's bytes."""
        for m in self.members:
            if not m.name:
                continue
            view = buffer[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)
            m.module._parameters[m.attr] = torch.nn.Parameter(view, requires_grad=False)


@dataclass(eq=False)
class Slot:
    """A pinned buffer a streamed group is read into (and, on CUDA, its twin on the GPU)."""

    host: torch.Tensor
    group: Optional[Group] = None
    request: object = None  # the engine's read in flight into ``host``
    ready: bool = False  # bytes of ``group`` are in ``host`` (and on the device, for CUDA)
    device: Optional[torch.Tensor] = None
    copied: object = None  # CUDA event: host -> device copy done
    computed: object = None  # CUDA event: the layer that used the device twin has run


def groups_of(model: torch.nn.Module) -> List[Group]:
    """The model's parameter groups in module order: each element of a ModuleList whose elements own
    parameters (the decoder layers), and each other module with parameters of its own."""
    groups: List[Group] = []
    inside: set = set()
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, torch.nn.ModuleList):
            for i, child in enumerate(module):
                if any(True for _ in child.parameters()):
                    groups.append(Group(len(groups), f"{name}.{i}", child, is_layer=True))
            inside.add(name)
            continue
        if any(True for _ in module.parameters(recurse=False)):
            groups.append(Group(len(groups), name or "(model)", module))
    return groups


def bind_sources(
    groups: List[Group],
    model: torch.nn.Module,
    source: WeightSource,
    dtype: Optional[torch.dtype],
    apart: frozenset = frozenset(),
) -> None:
    """Match every parameter of the model to a source tensor (tied parameters once, to the first group that
    names them), and place it in its group's bytes. The parameters of the modules in ``apart`` (their ids: the
    routed experts, :mod:`.expert_units`) are checked against the source but belong to no group."""
    tensors = source.tensors
    seen = {}  # id(parameter) -> (module, attr) of its first owner
    expected = set()
    for g in groups:
        prefix = "" if g.label == "(model)" else g.label + "."
        offset = 0
        params = (
            g.module.named_parameters() if g.is_layer else ((n, p) for n, p in g.module.named_parameters(recurse=False))
        )
        for rel, p in params:
            full = prefix + rel
            owner, attr = _owner(g.module, rel)
            if id(owner) in apart:
                expected.add(full)
                if full in tensors and tuple(tensors[full].shape) != tuple(p.shape):
                    raise ValueError(
                        f"{source.path}: tensor {full} has shape {list(tensors[full].shape)}, the model built from "
                        f"its config.json wants {list(p.shape)}: the weights are of another model"
                    )
                continue
            if id(p) in seen:
                g.members.append(Member(owner, attr, "", tuple(p.shape), p.dtype, -1, 0, tied_to=seen[id(p)]))
                continue
            seen[id(p)] = (owner, attr)
            expected.add(full)
            entry = tensors.get(full)
            if entry is None:
                continue  # reported below, all at once
            if tuple(entry.shape) != tuple(p.shape):
                raise ValueError(
                    f"{source.path}: tensor {full} has shape {list(entry.shape)}, the model built from its "
                    f"config.json wants {list(p.shape)}: the weights are of another model"
                )
            want = dtype if (dtype is not None and entry.dtype.is_floating_point) else entry.dtype
            nbytes = p.numel() * want.itemsize
            offset = align_up(offset, TENSOR_ALIGN)
            g.members.append(Member(owner, attr, full, tuple(p.shape), want, offset, nbytes))
            offset += nbytes
        g.nbytes = align_up(max(offset, 1), ALIGN)
    missing = sorted(n for n in expected if n not in tensors)
    extra = sorted(n for n in tensors if n not in expected and not _tied_name(model, n))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's tensors are missing ({', '.join(missing[:4])}, ...)")
        if extra:
            parts.append(f"{len(extra)} tensors are not the model's ({', '.join(extra[:4])}, ...)")
        raise ValueError(
            f"{source.path}: the weights do not match the model its config.json describes: "
            + "; ".join(parts)
            + ": the weights are of another model, or the folder mixes two"
        )


def _tied_name(model: torch.nn.Module, name: str) -> bool:
    """A tensor the file holds under a name the model ties to another (lm_head.weight with tied embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unique = dict(model.named_parameters())
    return name in params and name not in unique


def _owner(module: torch.nn.Module, rel: str):
    *path, attr = rel.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attr


def read_member(source: WeightSource, m: Member, dst: torch.Tensor) -> None:
    """Member ``m``'s bytes from the source into ``dst`` (uint8, m.nbytes), converted to its dtype where asked."""
    entry = source.tensors[m.name]
    if entry.dtype == m.dtype:
        source.read_into(m.name, dst)
    else:
        tmp = torch.empty(entry.nbytes, dtype=torch.uint8)
        source.read_into(m.name, tmp)
        dst.view(m.dtype).copy_(tmp.view(entry.dtype))
