"""Where each parameter group of a streamed model lives (:mod:`aidaptiv_ds.inference.streamed`): resident, read
from the swap file whole, read by rows or, on CUDA, copied from pinned host memory; through how many slots of
which size; encoded or not. The plan only decides (it reads the source to choose codes, and holds no pinned memory
and no swap file): the lay-out follows it.

Which groups stay resident (on CPU; CUDA's tiers are below): all of them when they fit the host budget. Otherwise
the groups outside the layer list (used at every step) and as many layers as fit stay resident, and the other
layers are laid into one swap file of the swap space. The exception is an input embedding table not tied to the
head: a step needs only the rows of its tokens, so the table is laid into the swap file too and its forward reads
those rows (a few KiB a token) into a small row buffer; the budget it would have held keeps layers resident
instead (tinyllama's 262 MB table is a layer and a half, read every step otherwise). The streamed layers go
through a ring of equal slots taken from the same pinned pool: two slots, so one layer computes while the next is
read; the rest of the budget holds resident layers.

On CPU the streamed layers can be stored encoded (``encode``; :mod:`aidaptiv_ds.inference.weight_codec`: each
floating-point element's top byte as a 4-bit code, lossless): bf16 layers are read in three quarters of their
bytes, fp32 layers in seven eighths. The slots then hold encoded layers, and one more buffer of a layer's size
holds the decoded layer its forward runs on. Choosing the codes takes one pass over the layers' weights before
the plan (the slot size is the largest encoded layer); the plan that reads fewer bytes a pass wins.

A mixture-of-experts model whose weights do not fit (on CPU) has its routed experts taken out of their layers
(:mod:`.expert_units`): a layer group is then its attention, norms, router and any shared expert, resident or
streamed as any layer, and the experts are read one by one as routers choose them into the slots of the expert
cache (:mod:`.expert_cache`), which takes what the budget leaves after everything else: layers used at every step
are worth more resident than an expert, which only some steps use. The plan reserves at least the experts one
token uses (``top_k`` slots).

On CUDA there are two budgets: the GPU budget holds the groups every step uses, the slots' GPU twins and as many
layers as fit (resident on the GPU); the host budget holds the pinned slots and, with what is left, layers kept
in pinned host memory, copied to their twin each pass without a disk read; only the rest is read from the swap
file.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from aidaptiv_ds.common.sizes import ALIGN, align_up, format_size
from aidaptiv_ds.inference.expert_units import ExpertSet, expert_sets_of, routed_modules
from aidaptiv_ds.inference.sources import WeightSource
from aidaptiv_ds.inference.weight_codec import codebook_for
from aidaptiv_ds.inference.weight_groups import (
    TENSOR_ALIGN,
    DeviceBudgetTooSmall,
    Group,
    HostBudgetTooSmall,
    bind_sources,
    groups_of,
    read_member,
)

# What generate's --encode-weights auto encodes: bf16 and fp16 layers (a quarter fewer bytes, decoded at about
# memory speed). fp32 saves an eighth and its decode writes four bytes an element: on the test machine it gained
# 3% and 6% in two runs, within their spread (bench/results/generate_offload/tinyllama-1.1b_fp32), so only "on" encodes it.
ENCODE_AUTO = (torch.bfloat16, torch.float16)
ENCODE_ALL = (torch.bfloat16, torch.float16, torch.float32)
# How a mixture-of-experts model's routed experts are read when the model does not fit: each expert as its router
# chooses it, or with its layer (every expert, every step: a dense model's streaming).
EXPERT_MODES = ("routed", "whole")
# Where routed experts are read from: the model's own files where they allow it (auto), or the swap file.
EXPERT_SOURCES = ("auto", "model", "swap")
_ROW_BUFFER_MAX = 8 << 20  # the row buffer of a table read by rows: a long prompt's rows go through it in turns


def _row_buffer_bytes(g: Group) -> int:
    """The pinned buffer a table read by rows needs: a sixteenth of the table up to 8 MiB, and at least one row
    with the 4 KiB pages on either side of it (O_DIRECT reads whole pages)."""
    return max(align_up(g.row_bytes) + 2 * ALIGN, min(_ROW_BUFFER_MAX, align_up(g.nbytes // 16)))


class WeightPlan:
    """Where each group of ``model`` (built empty) lives within the budgets, its parameters matched to ``source``'s
    tensors; the parameters are those of :class:`~aidaptiv_ds.inference.streamed.StreamedWeights` but
    ``nvme_path``. It sets each group's ``resident``, ``in_host``, ``by_rows`` and encoded size, and the sizes of
    what the lay-out allocates: ``slot_count`` slots of ``slot_bytes``, the row buffer (``row_buffer_bytes``), the
    decode buffer (``decode_bytes``) and the pinned pool that holds them (``_pool_bytes``).
    ``experts`` (one of EXPERT_MODES) and ``experts_from`` (one of EXPERT_SOURCES) say how a mixture-of-experts
    model's routed experts are read; the plan then sets ``expert_sets`` and the expert cache's ``expert_slots`` of
    ``expert_slot_bytes``, and ``experts_note`` says why experts stay in their layers when they do."""

    def __init__(
        self,
        model: torch.nn.Module,
        source: WeightSource,
        host_budget: int,
        device: str = "cpu",
        dtype: Optional[torch.dtype] = None,
        max_slots: int = 2,
        progress=None,
        device_budget: Optional[int] = None,
        encode: Tuple[torch.dtype, ...] = (),
        experts: str = "routed",
        experts_from: str = "auto",
    ):
        self.model, self.source, self.device = model, source, torch.device(device)
        if experts not in EXPERT_MODES:
            raise ValueError(f"`experts` {experts}: choose one of {', '.join(EXPERT_MODES)}")
        if experts_from not in EXPERT_SOURCES:
            raise ValueError(f"`experts_from` {experts_from}: choose one of {', '.join(EXPERT_SOURCES)}")
        if encode and self.device.type != "cpu":
            raise ValueError("encoded weights are decoded on the CPU: encode is for device 'cpu'")
        self.encode = tuple(encode)
        self.host_budget = int(host_budget)
        self.device_budget = None if self.device.type == "cpu" or device_budget is None else int(device_budget)
        self._progress = progress or (lambda msg: None)
        self.groups = groups_of(model)
        self.row_buffer_bytes = 0
        self.decode_bytes = 0  # the buffer encoded layers are decoded into (0: none encoded)
        self.expert_sets: List[ExpertSet] = []
        self.expert_slots, self.expert_slot_bytes, self.experts_note = 0, 0, ""
        self.experts_from = experts_from
        bind_sources(self.groups, model, source, dtype)
        if self._routes_experts(experts):
            modules, why = routed_modules(model)
            if why:
                self.experts_note = "experts streamed with their layers: " + "; ".join(why[:2])
            elif modules:
                # The experts leave their layers: each layer group is what every token uses.
                self.groups = groups_of(model)
                bind_sources(self.groups, model, source, dtype, apart=frozenset(id(m) for _, m in modules))
                self.expert_sets = expert_sets_of(model, modules, source, dtype)
                self._choose_expert_source(experts_from)
        self._plan(max_slots)
        if self.expert_sets:
            self._plan_expert_cache()

    def _routes_experts(self, experts: str) -> bool:
        """Whether routed experts are read apart: asked for, on CPU, and the weights do not fit the budget."""
        budget = self.host_budget if self.device_budget is None else self.device_budget
        if experts != "routed" or sum(g.nbytes for g in self.groups) <= budget:
            return False
        if self.device.type != "cpu":
            self.experts_note = "experts streamed with their layers: routed experts are read on CPU only for now"
            return False
        return True

    def _choose_expert_source(self, experts_from: str) -> None:
        """Read each set's experts in place where it can be and ``experts_from`` allows, else from the swap file."""
        for s in self.expert_sets:
            if experts_from != "swap" and s.reads_in_place is not None:
                s.use_in_place()
            elif experts_from == "model":
                raise ValueError(
                    f"`experts_from` model: the experts of {s.label} cannot be read from the model's files as they "
                    "are (another dtype asked for, a checkpoint of ours, or an expert's slice of a parameter in pieces, "
                    "as gate and up apart in the file): use `experts_from` auto or swap"
                )
        # A slot holds one expert however it is read (the lay-out may still fall back to the swap file).
        self.expert_slot_bytes = max(max(s.span, s.unit_bytes) for s in self.expert_sets)

    @property
    def _expert_reserve(self) -> int:
        """The least the expert cache needs: the experts one token uses in one layer."""
        if not self.expert_sets:
            return 0
        return max(s.top_k for s in self.expert_sets) * self.expert_slot_bytes

    def _plan_expert_cache(self) -> None:
        """The expert cache takes what the budget leaves (at least the reserve), up to every expert once."""
        left = self.host_budget - self._pool_bytes()
        most = sum(s.num_experts for s in self.expert_sets)
        self.expert_slots = min(most, left // self.expert_slot_bytes)

    def _plan(self, max_slots: int) -> None:
        """Choose resident groups and the number of slots within the host budget (and, on CUDA, the GPU's)."""
        total = sum(g.nbytes for g in self.groups)
        self.slot_bytes, self.slot_count = 0, 0
        if total + self._expert_reserve <= (self.host_budget if self.device_budget is None else self.device_budget):
            return  # everything resident, read once (routed experts aside)
        # A tie must bind one tensor for good, so layers taking part in one are not streamed.
        tied = {id(m.tied_to[0]) for g in self.groups for m in g.members if m.tied_to is not None}
        layers = [
            g
            for g in self.groups
            if g.is_layer and not any(m.tied_to is not None or id(m.module) in tied for m in g.members)
        ]
        outside = [g for g in self.groups if g not in layers]
        try:
            token_table = self.model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            token_table = None
        for g in outside:
            g.by_rows = g.module is token_table and self._reads_by_rows(g, tied)
            g.resident = not g.by_rows
        self.row_buffer_bytes = max((_row_buffer_bytes(g) for g in outside if g.by_rows), default=0)
        others = sum(g.nbytes for g in outside if not g.by_rows) + self.row_buffer_bytes + self._expert_reserve
        if not layers:
            if self.device_budget is not None:
                raise DeviceBudgetTooSmall(
                    f"GPU budget {format_size(self.device_budget)} is below the model's {format_size(total)} and "
                    "the model has no layer list to stream: give `gpu_budget` of at least the model's size"
                )
            raise HostBudgetTooSmall(
                f"host budget {format_size(self.host_budget)} is below the model's {format_size(total)} and the "
                "model has no layer list to stream: give `host_budget` of at least the model's size"
            )
        slot = max(g.nbytes for g in layers)
        if self.device_budget is not None:
            self._plan_device(layers, outside, others - self.row_buffer_bytes, slot, max_slots)
            return
        need = others + 2 * slot
        if need > self.host_budget:
            raise HostBudgetTooSmall(
                f"host budget {format_size(self.host_budget)} is too small for this model: it needs at least "
                f"{format_size(need)} (what every step uses resident, {format_size(others)}: "
                f"{self._outside_words(outside)}; plus two layers in flight, {format_size(slot)} each): give "
                f"`host_budget` {format_size(need)} or more"
            )
        plans = [self._plan_slots(layers, self.host_budget - others, slot, 0, max_slots, encoded=False)]
        if self.encode:
            self._choose_codes(layers)
            if any(g.encoded_nbytes for g in layers):
                # Encoded: the slots hold the largest encoded layer, and one more buffer the decoded layer.
                encoded_slot, decoded = max(g.read_nbytes for g in layers), max(g.nbytes for g in layers)
                left = self.host_budget - others - decoded
                if left >= 2 * encoded_slot:
                    plans.append(self._plan_slots(layers, left, encoded_slot, decoded, max_slots, encoded=True))
        # The plan that reads fewer bytes a pass (encoding costs a decode buffer: worth it unless few layers
        # stream); on a tie the one without decoding.
        read, resident, slots, slot, decoded, encoded = min(plans, key=lambda p: (p[0], p[5]))
        for g, keep in zip(layers, resident):
            g.resident = keep
        if not encoded:
            for g in layers:
                g.encoded_nbytes = 0
                for m in g.members:
                    m.book, m.encoded_offset = None, 0
        if not slots:  # the slots could hold every streamed layer: they are kept instead
            return
        self.slot_bytes, self.slot_count, self.decode_bytes = slot, slots, decoded

    @staticmethod
    def _plan_slots(layers: List[Group], left: int, slot: int, decoded: int, max_slots: int, encoded: bool):
        """Slots and resident layers within ``left`` bytes: (bytes read a pass, resident flags, slots, slot size,
        decode buffer, encoded). Two slots keep the disk busy (while layer i computes, layer i+1 is read; when i
        ends, i+2 is issued before i+1 is waited for); a byte beyond them is worth more as part of a resident
        layer, never read again, than as deeper read-ahead. ``max_slots`` allows more."""
        slots = max(2, min(max_slots, left // slot, len(layers)))
        left -= slots * slot
        resident = []
        for g in layers:
            resident.append(g.nbytes <= left)
            if resident[-1]:
                left -= g.nbytes
        streamed = [g for g, keep in zip(layers, resident) if not keep]
        if len(streamed) <= slots:  # the slots could hold every streamed layer: keep them instead
            return 0, [True] * len(layers), 0, 0, 0, False
        read = sum(g.read_nbytes if encoded else g.nbytes for g in streamed)
        return read, resident, slots, slot, decoded, encoded

    def _choose_codes(self, layers: List[Group]) -> None:
        """Each layer's codebooks and encoded layout (weight_codec): one pass over its weights, through one
        staging buffer of the largest tensor's size (freed after)."""
        staging = torch.empty(max(m.nbytes for g in layers for m in g.members), dtype=torch.uint8)
        for i, g in enumerate(layers):
            offset = 0
            for m in g.members:
                if not m.name:
                    continue
                m.book = None
                if m.dtype in self.encode:
                    data = staging[: m.nbytes]
                    read_member(self.source, m, data)
                    m.book = codebook_for(data, m.dtype)
                offset = align_up(offset, TENSOR_ALIGN)
                m.encoded_offset = offset
                offset += m.nbytes if m.book is None else m.book.nbytes
            encoded = align_up(max(offset, 1), ALIGN)
            if any(m.book is not None for m in g.members) and encoded < g.nbytes:
                g.encoded_nbytes = encoded
            else:
                for m in g.members:
                    m.book, m.encoded_offset = None, 0
            self._progress(f"chose the codes of {g.label} ({i + 1}/{len(layers)})")

    def _plan_device(self, layers: List[Group], outside: List[Group], others: int, slot: int, max_slots: int):
        """The CUDA plan: the groups every step uses (``others`` bytes), the slots' GPU twins and as many layers
        as fit stay on the GPU; the host budget holds the slots, the row buffer and, with what is left, layers in
        pinned memory (copied to the GPU each pass, no disk read); the other layers are read from the swap file."""
        need = others + 2 * slot
        if need > self.device_budget:
            raise DeviceBudgetTooSmall(
                f"GPU budget {format_size(self.device_budget)} is too small for this model: it needs at least "
                f"{format_size(need)} on the GPU (what every step uses, {format_size(others)}: "
                f"{self._outside_words(outside)}; plus two layers in flight, {format_size(slot)} each): give "
                f"`gpu_budget` {format_size(need)} or more, or use a GPU with more free memory"
            )
        host_need = 2 * slot + self.row_buffer_bytes
        if host_need > self.host_budget:
            raise HostBudgetTooSmall(
                f"host budget {format_size(self.host_budget)} is too small for this model: on CUDA it needs at least "
                f"{format_size(host_need)} (two pinned slots of {format_size(slot)}"
                + (f" and a row buffer of {format_size(self.row_buffer_bytes)}" if self.row_buffer_bytes else "")
                + f"): give `host_budget` {format_size(host_need)} or more"
            )
        slots = max(2, min(max_slots, (self.device_budget - others) // slot, len(layers)))
        on_gpu = self.device_budget - others - slots * slot
        in_host = self.host_budget - self.row_buffer_bytes - slots * slot
        for g in layers:
            g.resident = g.nbytes <= on_gpu
            if g.resident:
                on_gpu -= g.nbytes
            else:
                g.in_host = g.nbytes <= in_host
                if g.in_host:
                    in_host -= g.nbytes
        if all(g.resident for g in layers):
            return
        self.slot_bytes, self.slot_count = slot, slots

    @staticmethod
    def _reads_by_rows(g: Group, tied: set) -> bool:
        """Whether group ``g``, the model's token embedding (``get_input_embeddings``: its forward takes the
        token ids; a positional table such as OPT's takes a mask and offsets), is worth reading by rows: an
        ``nn.Embedding`` whose one weight no other module shares (a tied head needs the whole table every step)
        and that does not renormalise rows in place (``max_norm``), at least twice the size of the row buffer it
        needs instead."""
        m = g.members
        if not isinstance(g.module, torch.nn.Embedding) or len(m) != 1 or g.module.max_norm is not None:
            return False
        if m[0].tied_to is not None or not m[0].name or id(g.module) in tied or len(m[0].shape) != 2:
            return False
        g.row_bytes = m[0].shape[1] * m[0].dtype.itemsize
        return g.nbytes >= 2 * _row_buffer_bytes(g)

    def _outside_words(self, outside: List[Group]) -> str:
        kept = [g.label for g in outside if not g.by_rows]
        rows = [g.label for g in outside if g.by_rows]
        words = ", ".join(kept) or "nothing"
        if rows:
            words += f", and a row buffer for {', '.join(rows)} (read by rows)"
        if self.expert_sets:
            k = max(s.top_k for s in self.expert_sets)
            words += f", and the {k} experts a token uses ({format_size(self.expert_slot_bytes)} each)"
        return words

    def _pool_bytes(self) -> int:
        """Pinned host memory: the resident groups on CPU (on CUDA they live on the GPU), the in-host layers, the
        slots, the row buffer and the expert cache."""
        resident = self.resident_bytes if self.device.type == "cpu" else 0
        return max(
            ALIGN,
            resident
            + self.in_host_bytes
            + self.slot_count * self.slot_bytes
            + self.decode_bytes
            + self.row_buffer_bytes
            + self.expert_slots * self.expert_slot_bytes,
        )

    @property
    def streamed_groups(self) -> List[Group]:
        """The layers brought in whole every forward pass through the slots, in order (from the swap file, or on
        CUDA from pinned host memory)."""
        return [g for g in self.groups if not g.resident and not g.by_rows]

    @property
    def swap_groups(self) -> List[Group]:
        """The streamed layers read from the swap file."""
        return [g for g in self.streamed_groups if not g.in_host]

    @property
    def in_host_bytes(self) -> int:
        """Bytes of the layers kept in pinned host memory and copied to the GPU every pass (CUDA only)."""
        return sum(g.nbytes for g in self.groups if g.in_host)

    @property
    def row_groups(self) -> List[Group]:
        """The embedding tables read by rows."""
        return [g for g in self.groups if g.by_rows]

    @property
    def by_rows_bytes(self) -> int:
        """Bytes of the tables read by rows (in the swap file, not in memory)."""
        return sum(g.nbytes for g in self.row_groups)

    @property
    def streamed_bytes(self) -> int:
        """Bytes read from the swap file per forward pass (the layers neither resident nor in host memory;
        encoded, when they are)."""
        return sum(g.read_nbytes for g in self.swap_groups)

    @property
    def streamed_weight_bytes(self) -> int:
        """The weights' bytes of the layers read from the swap file per forward pass (before encoding)."""
        return sum(g.nbytes for g in self.swap_groups)

    @property
    def resident_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups if g.resident)

    @property
    def expert_bytes(self) -> int:
        """Bytes of the routed experts (read as routers choose them, not in the passes above)."""
        return sum(s.nbytes for s in self.expert_sets)

    @property
    def active_expert_bytes(self) -> int:
        """Bytes of the routed experts one token uses: ``top_k`` experts of every set."""
        return sum(s.top_k * s.expert_nbytes for s in self.expert_sets)
