"""The ``auto`` activation policy's plan: the mode of each transformer block, chosen from measured costs.

Each block runs in one of three modes:

- ``keep``: no checkpoint; autograd keeps what the block saves in memory. Costs memory (the block's saved
  tensors), no time.
- ``nvme``: no checkpoint; what the block saves goes to the rank's swap space while the forward runs and
  comes back, read ahead, during the backward (:class:`aidaptiv_ds.activations.store.ActivationStore`).
  Costs disk time (the bytes written and read again), almost no memory.
- ``recompute``: a non-reentrant checkpoint; only the block's input stays in memory and the backward runs
  the block again. Costs the block's forward time and its input's memory.

The rule (:func:`plan_blocks`), kept simple so the plan can be read and checked:

1. Keep as many blocks as the budget holds, counting every other block at its least (stored): blocks that
   add the fewest bytes first, later blocks first among equals (the backward needs them first).
2. Each other block is stored when the disk moves its saved tensors out and back in less time than
   recomputing it takes (``stored / write + stored / read < forward``: the disk's whole busy time for the
   block, no overlap with compute assumed), and recomputed otherwise.
3. Recomputed blocks keep their inputs in memory: if those do not fit beside the kept blocks, recomputed
   blocks are stored instead, earliest first (their inputs would be held the longest), until they do.

Nothing here measures or imports torch: :mod:`aidaptiv_ds.activations.policy` measures the costs during the
first training forward and applies the plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from aidaptiv_ds.common.sizes import MiB

MODES = ("keep", "nvme", "recompute")


@dataclass(frozen=True)
class BlockCost:
    """What one block costs, as measured in the first training forward."""

    index: int
    forward_s: float  # one forward of the block with autograd on: what a recompute costs
    saved_bytes: int  # memory its saved tensors hold when kept (distinct storages, parameters excluded)
    stored_bytes: int  # bytes the store writes for it (every saved tensor of at least min_bytes)
    left_bytes: int  # memory still held when it is stored (saved tensors too small to store)
    input_bytes: int  # memory a checkpoint keeps (its tensor arguments)

    def held(self, mode: str) -> int:
        """Memory this block's activations hold from its forward to its backward in ``mode``."""
        return {"keep": self.saved_bytes, "nvme": self.left_bytes, "recompute": self.input_bytes}[mode]

    def io_s(self, read_bps: float, write_bps: float) -> float:
        """Disk time to write what the block saves and read it back."""
        return self.stored_bytes / write_bps + self.stored_bytes / read_bps


@dataclass(frozen=True)
class BlockPlan:
    index: int
    mode: str
    why: str


def _mb(n: int) -> str:
    return f"{n / MiB:.2f} MiB"


def plan_blocks(costs: List[BlockCost], budget: int, read_bps: float, write_bps: float) -> List[BlockPlan]:
    """The mode of every block in ``costs`` under ``budget`` bytes (see the module's rule)."""
    if read_bps <= 0 or write_bps <= 0:
        raise ValueError(f"NVMe bandwidths must be positive, got read {read_bps} and write {write_bps} bytes/s")
    mode: Dict[int, str] = {}
    why: Dict[int, str] = {}
    used = sum(c.left_bytes for c in costs)
    for c in sorted(costs, key=lambda c: (c.saved_bytes - c.left_bytes, -c.index)):
        extra = c.saved_bytes - c.left_bytes
        if used + extra <= budget:
            used += extra
            mode[c.index] = "keep"
            why[c.index] = f"kept: its {_mb(c.saved_bytes)} fit the budget"
    for c in costs:
        if c.index in mode:
            continue
        io, fwd = c.io_s(read_bps, write_bps), c.forward_s
        over = f"keeping its {_mb(c.saved_bytes)} would exceed the budget"
        if io < fwd:
            mode[c.index] = "nvme"
            why[c.index] = (
                f"stored: {over}; writing and reading {_mb(c.stored_bytes)} takes {io * 1e3:.2f} ms, "
                f"less than the {fwd * 1e3:.2f} ms a recompute takes"
            )
        else:
            mode[c.index] = "recompute"
            why[c.index] = (
                f"recomputed: {over}; a recompute takes {fwd * 1e3:.2f} ms, no more than the "
                f"{io * 1e3:.2f} ms to write and read {_mb(c.stored_bytes)}"
            )
    total = sum(c.held(mode[c.index]) for c in costs)
    for c in sorted(costs, key=lambda c: c.index):
        if total <= budget:
            break
        if mode[c.index] != "recompute":
            continue
        mode[c.index] = "nvme"
        total -= c.input_bytes - c.left_bytes
        why[c.index] = (
            f"stored: its input ({_mb(c.input_bytes)}, which a recompute keeps) does not fit the budget "
            f"beside the kept blocks; the disk takes {c.io_s(read_bps, write_bps) * 1e3:.2f} ms, a "
            f"recompute {c.forward_s * 1e3:.2f} ms"
        )
    return [BlockPlan(c.index, mode[c.index], why[c.index]) for c in sorted(costs, key=lambda c: c.index)]


def summary(
    costs: List[BlockCost],
    plan: List[BlockPlan],
    budget: int,
    budget_source: str,
    read_bps: float,
    write_bps: float,
    bandwidth_source: str,
    unmeasured: Optional[List[int]] = None,
) -> dict:
    """The plan as the metrics report it (``activations.plan``)."""
    by_index = {c.index: c for c in costs}
    held = sum(by_index[p.index].held(p.mode) for p in plan)
    blocks = []
    for p in plan:
        c = by_index[p.index]
        blocks.append(
            {
                "block": p.index,
                "mode": p.mode,
                "why": p.why,
                "forward_ms": c.forward_s * 1e3,
                **{k: v for k, v in asdict(c).items() if k.endswith("_bytes")},
            }
        )
    return {
        "budget_bytes": budget,
        "budget_source": budget_source,
        "held_bytes": held,
        "fits": held <= budget,
        "nvme_read_bps": read_bps,
        "nvme_write_bps": write_bps,
        "nvme_bandwidth_source": bandwidth_source,
        "kept_blocks": [p.index for p in plan if p.mode == "keep"],
        "stored_blocks": [p.index for p in plan if p.mode == "nvme"],
        "recomputed_layers": [p.index for p in plan if p.mode == "recompute"],
        "unmeasured_blocks": list(unmeasured or []),
        "blocks": blocks,
    }


def render(s: dict) -> str:
    """The plan as the log prints it once: the budget and the rates it used, then one line per block."""
    lines = [
        f"activations auto: {len(s['kept_blocks'])} kept, {len(s['stored_blocks'])} stored on NVMe, "
        f"{len(s['recomputed_layers'])} recomputed; they hold {_mb(s['held_bytes'])} of a "
        f"{_mb(s['budget_bytes'])} budget ({s['budget_source']}); NVMe {s['nvme_write_bps'] / MiB:.0f} MiB/s "
        f"write, {s['nvme_read_bps'] / MiB:.0f} MiB/s read ({s['nvme_bandwidth_source']})"
    ]
    if not s["fits"]:
        lines.append(
            "  (over the budget even with every block stored: the saved tensors too small to store "
            "exceed it; raise activations.budget or lower activations.min_bytes)"
        )
    for b in s["blocks"]:
        lines.append(f"  block {b['block']}: {b['mode']}: {b['why']}")
    if s["unmeasured_blocks"]:
        lines.append(f"  blocks {s['unmeasured_blocks']} did not run in the measured forward: recomputed")
    return "\n".join(lines)
