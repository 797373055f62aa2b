"""The resolved block: :class:`SwapSettings` (frozen; the budget in bytes, the optimizer chunk in elements,
an absolute swap path, the I/O choices), :class:`ActivationSettings`, and the one rule for ``"auto"``
optimizer chunks (:func:`auto_chunk`), which the planner uses too."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional, Union

from aidaptiv_ds.common.sizes import KiB, MiB
from aidaptiv_ds.config.ds_config import ConfigError
from aidaptiv_ds.config.host import budget_bytes
from aidaptiv_ds.config.schema import (
    _NVME_PATH_REQUIRED,
    AidaptivConfig,
    _parse_block,
    parse_activation_budget,
    parse_bandwidth,
    parse_mmap_threshold,
    parse_retention,
)
from aidaptiv_ds.engine.backend import Backend


@dataclasses.dataclass(frozen=True)
class ActivationSettings:
    """A resolved ``"activations"`` object (the same names; ``budget`` in bytes and ``nvme_bandwidth`` in
    bytes/s, each None for "auto")."""

    policy: str = "keep"
    loss_chunk_tokens: int = 1024
    read_ahead: int = 2
    min_bytes: int = 64 * KiB
    budget: Optional[int] = None
    nvme_bandwidth: Optional[float] = None

    def __post_init__(self):
        # from_block passes the values pydantic dumps ("auto", "512MiB"); resolve them like the rest.
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)):
            object.__setattr__(self, "budget", parse_activation_budget(self.budget))
        if self.nvme_bandwidth is not None and not isinstance(self.nvme_bandwidth, float):
            object.__setattr__(self, "nvme_bandwidth", parse_bandwidth(self.nvme_bandwidth))

    def block(self) -> Dict[str, Any]:
        """As the block's ``"activations"`` object ("auto" where a value is None)."""
        out = dataclasses.asdict(self)
        for name in ("budget", "nvme_bandwidth"):
            if out[name] is None:
                out[name] = "auto"
        return out


# 'auto' optimizer chunks: small enough that several fit in the host budget at once (the step keeps
# reads ahead and writes behind in flight), large enough that each read and write is a long sequential
# request (at least 3 MiB of master and moments).
AUTO_CHUNK_MIN = 1 << 18
AUTO_CHUNK_MAX = 1 << 25


def auto_chunk(budget: int) -> int:
    """Elements of an optimizer chunk for a host budget of ``budget`` bytes: budget / 512, clamped to
    [AUTO_CHUNK_MIN, AUTO_CHUNK_MAX]. The one rule: the resolved settings and the planner both use it."""
    return max(AUTO_CHUNK_MIN, min(AUTO_CHUNK_MAX, budget // 512))


@dataclasses.dataclass(frozen=True)
class SwapSettings:
    """An enabled ``"aidaptiv"`` block, resolved: what the swappers, the planner and the engine read.

    The names are the block's, except that ``host_memory_budget`` (bytes, a share of RAM or a size string,
    per rank or per node) becomes ``host_budget_bytes``, this rank's share, and ``optimizer_chunk_numel`` is always a number ("auto" is sized from
    the budget here). ``nvme_path`` is absolute. Made by :meth:`from_block`, once per config."""

    nvme_path: str
    backend: Backend
    block_size: int
    queue_depth: int
    io_threads: int
    register_buffers: bool
    sqpoll: bool
    host_budget_bytes: int
    layer_group_size: int
    prefetch_depth: int
    optimizer_chunk_numel: int
    deferred_update: bool
    cache_optimizer_state: bool
    keep_swap_files: bool
    activations: ActivationSettings = ActivationSettings()
    retention_budget: int = 0  # bytes
    malloc_mmap_threshold: int = MiB  # bytes; 0: glibc's dynamic threshold
    trim_heap: Union[bool, str] = "auto"  # "auto": when training on the CPU (SwapRuntime decides)
    # Where block_size and queue_depth came from: "config" (a number in the block), "tuned" (the cached sweep
    # of the swap disk, for "auto"), "default" ("auto" on a disk never swept). Not compared: the same values
    # are the same settings, and the written-out block() says "config" for both.
    block_size_source: str = dataclasses.field(default="config", compare=False)
    queue_depth_source: str = dataclasses.field(default="config", compare=False)

    def __post_init__(self):
        # from_block passes the nested object as the dict pydantic dumps; resolve it like the rest.
        if isinstance(self.activations, dict):
            object.__setattr__(self, "activations", ActivationSettings(**self.activations))

    @classmethod
    def from_block(
        cls,
        block: Union[Dict[str, Any], AidaptivConfig],
        ram_bytes: Optional[int] = None,
        local_ranks: Optional[int] = None,
    ) -> "SwapSettings":
        """Resolve a block (a dict, or one pydantic already parsed) that names its ``nvme_path``.

        ``ram_bytes`` is the memory this node may use; it is read (``engine.machine.total_ram_bytes``, which
        reads the cgroup files) only when the budget is a share of RAM and it is not given. ``local_ranks`` (the
        ranks on this node, :func:`local_rank_count` when not given) splits a per-node budget; the result is
        this rank's share. Raises :class:`ConfigError` for a block that does not parse or has no
        ``nvme_path``."""
        cfg = block if isinstance(block, AidaptivConfig) else _parse_block(block)
        if not cfg.nvme_path:
            raise ConfigError([_NVME_PATH_REQUIRED])
        nbytes = budget_bytes(cfg.host_memory_budget, ram_bytes, local_ranks)
        chunk = cfg.optimizer_chunk_numel
        if chunk == "auto":
            chunk = auto_chunk(nbytes)
        from aidaptiv_ds.engine.tuning import resolve_io

        path = os.path.abspath(cfg.nvme_path)
        auto = lambda v: None if v == "auto" else v
        block, depth, block_source, depth_source = resolve_io(path, auto(cfg.block_size), auto(cfg.queue_depth))
        same = cfg.model_dump(
            exclude={
                "enabled",
                "nvme_path",
                "host_memory_budget",
                "optimizer_chunk_numel",
                "retention_budget",
                "block_size",
                "queue_depth",
                "malloc_mmap_threshold",
            }
        )
        return cls(
            nvme_path=path,
            host_budget_bytes=nbytes,
            optimizer_chunk_numel=chunk,
            block_size=block,
            queue_depth=depth,
            block_size_source=block_source,
            queue_depth_source=depth_source,
            retention_budget=parse_retention(cfg.retention_budget),
            malloc_mmap_threshold=parse_mmap_threshold(cfg.malloc_mmap_threshold),
            **same,
        )

    def block(self) -> Dict[str, Any]:
        """These settings as an ``"aidaptiv"`` block with every value explicit (bytes, elements, an absolute
        path): what the translated DeepSpeed config carries. Resolving it again gives these settings
        without reading the machine."""
        out = dataclasses.asdict(self)
        out["backend"] = self.backend.value
        out["activations"] = self.activations.block()
        out["host_memory_budget"] = out.pop("host_budget_bytes")
        del out["block_size_source"], out["queue_depth_source"]
        return {"enabled": True, **out}
