"""The expert cache of streamed mixture-of-experts generation: the routed experts a step uses are read into slots
of one pinned buffer, or found there, and the experts module computes on views of that buffer.

    cache = ExpertCache(pool, slot_bytes, sets, engine, files, stats)
    cache.attach()       # each experts module's forward now reads the experts its router chose
    ...
    cache.detach()

**Per step and layer, the router first.** The experts module is called by its MoE block after the router with
``(hidden_states, top_k_index, top_k_weights)``. Its forward is replaced (on the instance) by one that takes the
distinct experts of ``top_k_index`` (for a batch or a prompt: the union of its tokens' experts, each read once),
makes sure each is in a slot (a hit, or one read per parameter into a free or evicted slot, all issued before
the first wait), renumbers ``top_k_index`` to slots and calls the module's own forward: its parameters are bound
for good to views of the whole buffer, [slots, *one expert's shape] (:meth:`ExpertSet.views`), and
``num_experts`` to the number of slots. transformers' grouped_mm and batched_mm compute each token from its own
experts' rows and sum a token's experts in top-k order, so the renumbering changes no bit of the result.

**Computed as they arrive.** With misses to read, the experts the cache held are computed first and each missed
one as soon as its reads are done, while the later ones are still being read: a layer costs its reads plus the
compute of its last expert, not its reads plus all of its compute. Each (token, expert) pair goes through the
module's own forward alone, then the pairs are weighed and summed as the module sums them (same bits).

**Most-used first.** Each expert's uses (tokens routed to it) are counted over the whole run. A miss takes a free
slot, else the slot whose expert has the fewest uses (the least recently used among equals), never one the step
needs: the experts used most stay. When a step needs more experts than there are slots (a long prompt with a small
budget), its tokens run in turns, each turn's experts fitting the slots: a token's output is computed from its
own experts alone, so the turns give the same bits.

Counted in ``stats`` (shared with the read ring): ``expert_lookups`` (experts a step and layer needed),
``expert_hits``, ``expert_reads`` and ``expert_bytes_read`` (also in ``reads`` and ``bytes_read``),
``expert_wait_s`` (also in ``wait_s``), ``expert_bytes_moved`` (experts read in place moved within their
slots, :meth:`ExpertSet.moves`) and ``expert_steps_pipelined`` (module calls whose experts were computed as
their reads completed, :meth:`ExpertCache._pipelined`).
"""

from __future__ import annotations

import ctypes
import inspect
import time
from typing import Dict, List, Optional

import torch

from aidaptiv_ds.inference.expert_units import ExpertSet

_FREE = -1
_NEEDED = torch.iinfo(torch.int64).max


class ExpertCache:
    """Experts of ``sets`` in the slots of ``pool`` (pinned, ``slot_bytes`` a slot), read with ``engine`` from the
    swap file (``files[None]``) or the model's files (``files[path]``, with ``sizes[path]`` their sizes)."""

    def __init__(
        self,
        pool: torch.Tensor,
        slot_bytes: int,
        sets: List[ExpertSet],
        engine,
        files: Dict[Optional[str], object],
        sizes: Dict[Optional[str], int],
        stats: dict,
    ):
        self.pool, self.slot_bytes, self.sets = pool, slot_bytes, sets
        self.engine, self.files, self.sizes, self.stats = engine, files, sizes, stats
        self.slots = pool.numel() // slot_bytes
        if self.slots < max(s.top_k for s in sets):
            raise ValueError(f"an expert cache of {self.slots} slots cannot hold the experts one token uses")
        self.slot_of = [torch.full((s.num_experts,), _FREE, dtype=torch.int64) for s in sets]
        self.uses = [torch.zeros(s.num_experts, dtype=torch.int64) for s in sets]
        self.held: List[Optional[tuple]] = [None] * self.slots  # (set index, expert) in each slot
        # Eviction order: free slots first (-1), then fewest uses, then least recently used.
        self.rank = torch.full((self.slots,), _FREE, dtype=torch.int64)
        self.clock = 0
        self._saved: list = []
        for key in (
            "expert_lookups",
            "expert_hits",
            "expert_reads",
            "expert_bytes_read",
            "expert_bytes_moved",
            "expert_steps_pipelined",
        ):
            stats.setdefault(key, 0)
        stats.setdefault("expert_wait_s", 0.0)

    # ------------------------------------------------------------------------------------------ binding

    def attach(self) -> None:
        """Bind every set's parameters to views of the pool and route its module's forward through the cache."""
        if self._saved:
            return
        for s in self.sets:
            m = s.module
            self._saved.append((m, m.num_experts, {p.attr: m._parameters[p.attr] for p in s.params}))
            for attr, view in s.views(self.pool, self.slot_bytes).items():
                m._parameters[attr] = torch.nn.Parameter(view, requires_grad=False)
            m.num_experts = self.slots
            m.forward = self._routed_forward(s)

    def detach(self) -> None:
        for m, num, params in self._saved:
            m.__dict__.pop("forward", None)
            m.num_experts = num
            m._parameters.update(params)
        self._saved = []

    def _routed_forward(self, s: ExpertSet):
        module = s.module
        original = type(module).forward
        names = list(inspect.signature(original).parameters)[1:4]  # hidden states, top-k index, top-k weights

        def forward(*args, **kwargs):
            bound = dict(zip(names, args))
            bound.update(kwargs)
            hidden, index, weights = (bound.pop(n) for n in names)
            turns = self._turns(s, index)
            outs = []
            for rows in turns:
                idx = index if rows is None else index[rows]
                h, w = (hidden, weights) if rows is None else (hidden[rows], weights[rows])
                experts, counts = torch.unique(idx.reshape(-1).cpu(), return_counts=True)
                pending = self._load(s, experts, counts, wait=not self._pipelines(s, h, idx))
                slots = self.slot_of[s.index].to(idx.device)[idx]
                if not pending:
                    outs.append(original(module, h, slots, w, **bound))
                else:
                    outs.append(self._pipelined(s, original, h, idx, slots, w, pending, bound))
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

        return forward

    def _pipelines(self, s: ExpertSet, hidden: torch.Tensor, index: torch.Tensor) -> bool:
        """Whether a step's experts are computed while its misses are still being read (see :meth:`_pipelined`):
        where the experts compute in the hidden states' dtype, so a pair's output taken alone is the bits the
        module sums, on the (tokens, hidden) and (tokens, k) tensors transformers' implementations take."""
        return hidden.dim() == 2 and index.dim() == 2 and all(p.dtype == hidden.dtype for p in s.params)

    def _pipelined(self, s, original, hidden, index, slots, weights, pending, bound) -> torch.Tensor:
        """The module's output with its experts computed as they arrive: first the experts the cache held, then
        each missed one as soon as its reads are done (its moves made), while the reads of the others go on.

        Each (token, expert) pair is computed by the module's own forward with that pair alone in its top-k and a
        weight of one: its grouped or batched product of the same rows of the same expert, so the same bits; then
        the pairs are weighed and summed as the module sums them (``(out * weight).view(tokens, k,
        hidden).sum(1)``, transformers' grouped_mm and batched_mm), the same bits as one call."""
        tokens, k = index.shape
        flat = index.reshape(-1)
        rows = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
        pair_slots = slots.reshape(-1, 1)
        one = torch.ones(1, 1, dtype=weights.dtype, device=weights.device)
        out = torch.empty(tokens * k, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)

        def compute(mask: torch.Tensor) -> None:
            at = mask.nonzero().squeeze(1)
            if at.numel():
                out[at] = original(s.module, hidden[rows[at]], pair_slots[at], one.expand(at.numel(), 1), **bound)

        self.stats["expert_steps_pipelined"] += 1
        missed = torch.tensor([e for e, _, _ in pending], dtype=flat.dtype)
        try:
            compute(~torch.isin(flat.cpu(), missed).to(flat.device))
            for expert, slot, requests in pending:
                self._await(requests)
                self._move(s, expert, slot)
                compute(flat == expert)
        except BaseException:
            self._forget(s, pending)
            raise
        weighted = out * weights.reshape(-1).unsqueeze(-1)
        return weighted.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)

    def _turns(self, s: ExpertSet, index: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """[None] when the step's experts fit the slots; else the tokens in turns (rows of ``index``), in order,
        each turn's experts at most the slots."""
        flat = index.reshape(index.shape[0], -1).cpu()
        if torch.unique(flat).numel() <= self.slots:
            return [None]
        turns, current, seen = [], [], set()
        for t, row in enumerate(flat.tolist()):
            new = seen | set(row)
            if current and len(new) > self.slots:
                turns.append(torch.tensor(current))
                current, new = [], set(row)
            current.append(t)
            seen = new
        turns.append(torch.tensor(current))
        return turns

    # ------------------------------------------------------------------------------------------ reads

    def _load(self, s: ExpertSet, experts: torch.Tensor, counts: torch.Tensor, wait: bool = True) -> list:
        """Make sure ``experts`` (distinct) of set ``s`` are in slots; ``counts``: tokens routed to each. All the
        misses are issued before anything waits; with ``wait`` False nothing waits, and the misses come back as
        (expert, slot, requests) for the caller to wait on (and move, :meth:`_move`) one by one."""
        self.clock += 1
        slot_of, uses = self.slot_of[s.index], self.uses[s.index]
        uses.index_add_(0, experts, counts)
        where = slot_of[experts]
        missing = experts[where == _FREE].tolist()
        self.stats["expert_lookups"] += experts.numel()
        self.stats["expert_hits"] += experts.numel() - len(missing)
        present = where[where != _FREE]
        if missing:
            rank = self.rank.clone()
            rank[present] = _NEEDED  # what this step needs stays
            victims = torch.topk(rank, len(missing), largest=False).indices.tolist()
            pending = []
            for e, slot in zip(missing, victims):
                old = self.held[slot]
                if old is not None:
                    self.slot_of[old[0]][old[1]] = _FREE
                self.held[slot] = (s.index, e)
                slot_of[e] = slot
                pending.append((e, slot, self._issue(s, e, slot)))
        else:
            pending = []
        # Fewest uses first out, then least recently used: uses in the high bits, the step in the low ones.
        self.rank[slot_of[experts]] = (uses[experts] << 32) | self.clock
        if pending and wait:
            try:
                self._await([r for _, _, requests in pending for r in requests])
            except BaseException:
                self._forget(s, pending)
                raise
            for e, slot, _ in pending:
                self._move(s, e, slot)
            return []
        return pending

    def _await(self, requests: list) -> None:
        """Wait for ``requests`` (a failed read raises its error: file, offset, errno), the time counted."""
        t0 = time.perf_counter()
        for r in requests:
            r.wait()
        waited = time.perf_counter() - t0
        self.stats["expert_wait_s"] += waited
        self.stats["wait_s"] += waited

    def _forget(self, s: ExpertSet, pending: list) -> None:
        """After a read of ``pending`` failed (or the step was interrupted): let every one of their reads end, so
        none still writes into the pool, then empty their slots, so that a later step (a server goes on after a
        failed request) reads those experts again instead of computing on bytes that did not arrive whole."""
        for e, slot, requests in pending:
            for r in requests:
                try:
                    r.wait()
                except Exception:  # noqa: BLE001 - the first failure is the one the caller raises
                    pass
            if self.held[slot] == (s.index, e):
                self.slot_of[s.index][e] = _FREE
                self.held[slot] = None
                self.rank[slot] = _FREE

    def _move(self, s: ExpertSet, expert: int, slot: int) -> None:
        """Put the parameters of ``expert``, read in place, where the views see them (an expert of a shard that
        lies otherwise against the pages than most): memmoves within its slot, in the order planned."""
        moves = s.moves(expert)
        if not moves:
            return
        base = self.pool.data_ptr() + slot * self.slot_bytes
        for src, dst, n in moves:
            ctypes.memmove(base + dst, base + src, n)
            self.stats["expert_bytes_moved"] += n

    def _issue(self, s: ExpertSet, expert: int, slot: int) -> list:
        base = slot * self.slot_bytes
        requests = []
        for path, offset, nbytes, place in s.reads(expert):
            n = min(nbytes, self.sizes[path] - offset)  # the last page of a file may be short
            buf = self.pool[base + place : base + place + n]
            requests.append(self.engine.read_async(buf, self.files[path], offset))
            self.stats["expert_reads"] += 1
            self.stats["expert_bytes_read"] += n
            self.stats["reads"] += 1
            self.stats["bytes_read"] += n
        return requests
