"""The ``"aidaptiv"`` block of a DeepSpeed JSON config: its model, its validation, its one resolution, and
the translation DeepSpeed needs.

A user enables our swapper by adding a top-level block to an ordinary DeepSpeed ZeRO-3 config::

    "aidaptiv": {"enabled": true, "nvme_path": "/mnt/nvme/swap", "host_memory_budget": "25%"}

:func:`validate` checks the block and the parts of the DeepSpeed config it depends on, reports every
problem at once before any file is opened, and resolves the block into :class:`SwapSettings`: a frozen
object with the budget in bytes, the optimizer chunk in elements and an absolute swap path, which every
layer below receives instead of re-deriving anything. :func:`to_deepspeed_config` then writes the offload
settings DeepSpeed needs to take its NVMe code paths (where our swappers are plugged in); the user never
sets buffer counts or buffer sizes.

:func:`resolve` does both once per config per process (``zero_init`` and ``initialize`` get the same
config; DeepSpeed's two entry points under the Hugging Face Trainer or accelerate get it with "auto" values
and then with the trainer's numbers in their place, which resolve to the same settings and, where we
bound a setting that said "auto", to our value both times). DeepSpeed ignores unknown
top-level keys, so the translated config keeps the block, in resolved form; DeepSpeed hands our
parameter-swapper factory only its config object, and :func:`settings_for` maps that block back to the
settings resolved for it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from aidaptiv_ds.ds_config import ConfigError, dtype_name, precision_enabled
from aidaptiv_ds.io_backend import Backend
from aidaptiv_ds.sizes import ALIGN, GiB, KiB, MiB, dtype_bytes, parse_size

BLOCK = "aidaptiv"


def parse_budget(value: Union[int, float, str]) -> Tuple[Optional[int], Optional[float]]:
    """Return (bytes, fraction_of_ram): an int is bytes, a float in (0, 1) or "N%" is a fraction of RAM,
    a string with a unit is bytes as :func:`aidaptiv_ds.sizes.parse_size` reads it ("4GB" decimal,
    "512MiB" binary)."""
    if isinstance(value, bool):
        raise ValueError("expected bytes, a fraction of RAM or a size string, got a boolean")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a byte budget must be positive, got {value}")
        return value, None
    if isinstance(value, float):
        if not 0.0 < value < 1.0:
            raise ValueError(f"a fraction of RAM must be between 0 and 1 (exclusive), got {value}")
        return None, value
    text = str(value).strip()
    if text.endswith("%"):
        pct = float(text[:-1])
        if not 0.0 < pct < 100.0:
            raise ValueError(f"a percentage of RAM must be between 0 and 100 (exclusive), got {text}")
        return None, pct / 100.0
    try:
        nbytes = parse_size(text)
    except ValueError:
        raise ValueError(f"'{text}' is not a size: use bytes (268435456), a unit (256MiB, 4GB) or a share of "
                         "RAM (25%)") from None
    if nbytes <= 0:
        raise ValueError(f"a byte budget must be positive, got {text}")
    return nbytes, None


PER_RANK, PER_NODE = "rank", "node"


def parse_mmap_threshold(value: Union[int, str]) -> int:
    """A ``malloc_mmap_threshold`` in bytes: 0, or a size up to glibc's 32 MiB limit."""
    from aidaptiv_ds.malloc_threshold import MAX_THRESHOLD
    nbytes = parse_retention(value)
    if nbytes > MAX_THRESHOLD:
        raise ValueError(f"{nbytes} bytes is above glibc's limit of 32MiB ({MAX_THRESHOLD} bytes)")
    return nbytes


def parse_retention(value: Union[int, str]) -> int:
    """A ``retention_budget`` in bytes (an int, or a size as :func:`aidaptiv_ds.sizes.parse_size` reads it).
    ("auto" is not offered: our train job refuses "auto" anywhere, as values only a trainer fills in.)"""
    if isinstance(value, bool):
        raise ValueError("expected bytes or a size such as '256MiB', got a boolean")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = parse_size(text)
        except ValueError:
            raise ValueError(f"'{text}' is not a size: use bytes (268435456) or a unit (256MiB)") from None
    if value < 0:
        raise ValueError(f"expected a size of at least 0 bytes, got {value}")
    return int(value)


def parse_host_budget(value: Union[int, float, str]) -> Tuple[Optional[int], Optional[float], str]:
    """Return (bytes, share_of_ram, scope) of a ``host_memory_budget``; scope is "node" (split between the
    node's ranks) or "rank". A share of RAM is always of the node; a size is per rank unless it ends in
    "/node" (an int, or a size without a suffix, stays per rank as it always was)."""
    scope = None
    if isinstance(value, str) and "/" in value:
        head, _, tail = value.rpartition("/")
        scope = tail.strip().lower()
        if scope not in (PER_RANK, PER_NODE):
            raise ValueError(f"'{value}': after '/' expected 'node' or 'rank' (e.g. '64GiB/node', '16GiB/rank')")
        value = head.strip()
    nbytes, fraction = parse_budget(value)
    if fraction is not None:
        if scope == PER_RANK:
            raise ValueError("a share of RAM is a share of the node, split between its ranks: give it without "
                             "'/rank', or give each rank a size ('16GiB/rank')")
        return None, fraction, PER_NODE
    return nbytes, None, scope or PER_RANK


# Where launchers say how many ranks run on this node: torchrun/accelerate, the deepspeed launcher, Open MPI.
LOCAL_RANK_COUNT_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def local_rank_count(env=None) -> int:
    """Ranks of this job on this node, from the launcher's environment; 1 without a launcher."""
    env = os.environ if env is None else env
    for name in LOCAL_RANK_COUNT_VARS:
        text = (env.get(name) or "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def _cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The tightest memory limit on this process's cgroup and its ancestors (v2 memory.max, or v1
    memory.limit_in_bytes), or None when there is none."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            base, name = root, "memory.max"                                   # cgroup v2
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"  # cgroup v1
        else:
            continue
        path = path.strip("/")
        while True:
            try:
                with open(os.path.join(base, path, name)) as f:
                    text = f.read().strip()
                if text.isdigit() and int(text) < (1 << 60):  # v1 writes a huge number for "no limit"
                    candidates.append(int(text))
            except OSError:
                pass
            if not path:
                break
            path = os.path.dirname(path)
    return min(candidates) if candidates else None


def total_ram_bytes() -> int:
    """Memory this process may use: physical RAM, or its cgroup's limit when lower (a container, a SLURM
    job, a sweep's host cap), so that a budget given as a share of RAM stays inside such a limit."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_memory_limit()
    return min(physical, limit) if limit else physical


class ActivationsConfig(BaseModel):
    """How the activations a forward saves for its backward are held (the block's ``"activations"`` object);
    applied by :mod:`aidaptiv_ds.zero3.activations`."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["keep", "recompute", "nvme", "auto"] = Field(
        "keep", description="keep: activations stay in memory as the model saves them. recompute: gradient "
                            "checkpointing of every transformer block (only each block's input is kept; the "
                            "block is recomputed in the backward). nvme: recompute, and each block's input is "
                            "written to this rank's swap space during the forward and read back, ahead of "
                            "need, during the backward. auto: a plan per block from what the first training "
                            "forward measures: keep the blocks the activation budget holds; store each other "
                            "block's saved tensors on NVMe (no recompute) when writing and reading them takes "
                            "less time than recomputing the block, else recompute it (see docs/DESIGN.md).")
    loss_chunk_tokens: int = Field(
        1024, ge=0, description="Tokens per chunk of the LM head and loss: the full tokens x vocabulary logits "
                                "and their gradient never exist at once (Llama, Qwen2 and Mistral models; "
                                "the same loss). 0 computes the model's own unchunked loss.")
    read_ahead: int = Field(2, ge=0, le=64, description="nvme and auto: stored activations read ahead of the "
                                                        "backward (each in a staging buffer of the host budget).")
    min_bytes: int = Field(64 * KiB, ge=0, description="nvme and auto: saved tensors smaller than this stay in "
                                                       "memory (token ids, masks).")
    budget: Union[int, str] = Field(
        "auto", description="auto only: memory the blocks' activations may hold (bytes or a size, '512MiB'). "
                            "'auto': on CUDA half the GPU memory free when the plan is made (the other half "
                            "for the backward's gradients and recompute); on CPU this rank's host_memory_budget "
                            "(the activations live in ordinary memory beside it).")
    nvme_bandwidth: Union[int, float, str] = Field(
        "auto", description="auto only: bytes/s the swap disk reads and writes activations at (a number, or a "
                            "size per second such as '2GiB'). 'auto': the rates 'aidaptiv-ds plan --nvme' "
                            "measured for this disk (its cache), else a short write and read-back through the "
                            "engine when the plan is made.")

    @field_validator("budget")
    @classmethod
    def _check_budget(cls, value):
        parse_activation_budget(value)
        return value

    @field_validator("nvme_bandwidth")
    @classmethod
    def _check_bandwidth(cls, value):
        parse_bandwidth(value)
        return value

    @model_validator(mode="after")
    def _auto_only(self):
        given = [n for n in ("budget", "nvme_bandwidth") if getattr(self, n) != "auto"]
        if given and self.policy != "auto":
            raise ValueError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to policy "
                             f"\"auto\" only, but the policy is \"{self.policy}\": remove "
                             f"{'them' if len(given) > 1 else 'it'} or set the policy to \"auto\"")
        return self


def parse_activation_budget(value: Union[int, str]) -> Optional[int]:
    """``activations.budget`` in bytes, or None for "auto"."""
    if value == "auto":
        return None
    try:
        return parse_size(value.strip() if isinstance(value, str) else value, "budget")
    except ValueError as e:
        raise ValueError(f"{e}; or 'auto'") from None


def parse_bandwidth(value: Union[int, float, str]) -> Optional[float]:
    """``activations.nvme_bandwidth`` in bytes/s, or None for "auto"; a size may end in "/s"."""
    if value == "auto":
        return None
    if isinstance(value, bool):
        raise ValueError("expected bytes per second or 'auto', got a boolean")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = parse_size(text[:-2] if text.endswith("/s") else text, "nvme_bandwidth")
        except ValueError as e:
            raise ValueError(f"{e}; or 'auto'") from None
    if not value > 0:
        raise ValueError(f"expected a bandwidth above 0 bytes/s or 'auto', got {value}")
    return float(value)


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


class AidaptivConfig(BaseModel):
    """Settings of the aidaptiv NVMe swapper (the ``"aidaptiv"`` block of a DeepSpeed config)."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    enabled: bool = Field(False, description="Turn the swapper on. When false the block is ignored and DeepSpeed "
                                             "runs exactly as configured.")
    nvme_path: Optional[str] = Field(None, description="Directory for the swap space (one subfolder per rank). It must "
                                                        "exist, be writable and sit on a filesystem that supports "
                                                        "O_DIRECT (not tmpfs).")
    backend: Backend = Field(Backend.AUTO, description="I/O backend: io_uring, posix (thread pool) or auto (io_uring, "
                                                       "falling back to posix with a message).")
    block_size: Union[int, str] = Field(
        "auto", description="Bytes per I/O piece (4 KiB to 64 MiB, a multiple of 4 KiB; a number or a size such as "
                            "'1MiB'); a larger transfer is split "
                            "into pieces of this size. 'auto': the choice of 'aidaptiv-ds plan --nvme' for this disk "
                            "(an O_DIRECT sweep, cached per disk), or 1048576 when the disk was never swept.")
    queue_depth: Union[int, str] = Field(
        "auto", description="I/O pieces in flight per engine (1 to 4096). 'auto': the choice of 'aidaptiv-ds plan "
                            "--nvme' for this disk (with the block_size given, if one is), or 32 when the disk was "
                            "never swept.")
    io_threads: int = Field(4, ge=1, le=256, description="Threads of the posix backend.")
    register_buffers: bool = Field(True, description="Register the pinned pool with io_uring as fixed buffers "
                                                     "(falls back to plain buffers when the memlock limit refuses).")
    sqpoll: bool = Field(False, description="Use an io_uring submission-queue polling thread (costs a core).")
    host_memory_budget: Union[int, float, str] = Field(
        "25%", description="Host RAM for pinned staging buffers and the RAM cache tier, together. A share of RAM "
                           "('25%' or a float in (0,1)) is a share of the node (or of its cgroup limit) for all its "
                           "ranks together, split evenly between them (LOCAL_WORLD_SIZE, set by torchrun and "
                           "accelerate; LOCAL_SIZE, set by the deepspeed launcher). A size is per rank ('16GiB', "
                           "'16GiB/rank', or bytes as an int) or per node, split the same way ('64GiB/node'). A total "
                           "over the node's RAM is refused; one over the locked-memory limit (ulimit -l) is warned "
                           "about (the pool then works unlocked). The pool is sized from the model and never "
                           "exceeds a rank's share.")
    layer_group_size: int = Field(4, ge=1, le=1024, description="Transformer layers per group (at most): the "
                                                               "unit of prefetch, contiguous on disk. Groups "
                                                               "shrink when the budget cannot prefetch them.")
    prefetch_depth: int = Field(1, ge=0, le=16, description="Layer groups read ahead of the one computing.")
    optimizer_chunk_numel: Union[int, str] = Field(
        "auto", description="Elements per optimizer chunk (and DeepSpeed's sub_group_size): the unit of optimizer "
                            "read-ahead and write-behind. 'auto' sizes it from the host budget.")
    deferred_update: bool = Field(True, description="fp32 models: apply each parameter's optimizer update when "
                                                    "the next forward fetches it (same result; the forward's "
                                                    "read of the parameters serves the update, and the "
                                                    "update's I/O overlaps forward compute).")
    cache_optimizer_state: bool = Field(True, description="Keep optimizer sub-groups resident in the host budget's "
                                                          "leftover (after staging); they then skip NVMe each step.")
    keep_swap_files: bool = Field(False, description="Leave the swap files in place at exit (they are removed "
                                                     "otherwise). Checkpoints never depend on them.")
    retention_budget: Union[int, str] = Field(
        0, description="Host memory (inside host_memory_budget) that keeps the last layer groups of the forward "
                       "resident until the backward has used them, so the backward does not read them from NVMe "
                       "again: bytes or a size ('256MiB'), in whole layer-group slots; a run whose budget holds "
                       "less beyond the swapper's minimum is refused, saying how much fits. 0: none beyond what "
                       "the cache keeps by itself.")
    malloc_mmap_threshold: Union[int, str] = Field(
        "1MiB", description="Fix glibc's mmap threshold at this size (bytes or a size, at most '32MiB'; 0 leaves "
                            "glibc's dynamic threshold): host allocations above it are mapped on their own and "
                            "returned to the system when freed. With glibc's default the threshold climbs to the "
                            "size of the first large tensor freed, and later ones below it stay in the heap after "
                            "they are freed, growing the process's RSS by hundreds of MiB over what is live "
                            "(aidaptiv_ds/malloc_threshold.py). Set once per process, when the swapper starts. The cost is a fresh "
                            "zero-filled mapping per large allocation: on the tiny preset on 2 CPU cores, untrimmed, "
                            "1303 against 1437 MiB peak RSS for a 0.836 against 0.851 s step (bench/results/"
                            "malloc_threshold); '128KiB' beside the heap trimming saves another 1-3% for steps 7-12% "
                            "longer; 0 when speed matters more than RAM.")
    trim_heap: Union[StrictBool, Literal["auto"]] = Field(
        "auto", description="Give the heap's free pages back to the system (glibc's malloc_trim) at the end of each "
                            "forward, backward and optimizer step and as the backward enters each layer group. Tensors below the mmap threshold that are freed "
                            "in an order leaving holes keep their pages resident otherwise: on the CPU, where "
                            "activations and gradients are host memory, hundreds of MiB at the peak. On 2 CPU cores, "
                            "small at 0.4 of its state: 2518 against 2742 MiB for a 3.610 against 3.553 s step; tiny "
                            "at 0.6: 1227 against 1303 MiB for 0.949 against 0.836 s (medians of 3 interleaved runs, "
                            "bench/results/malloc_threshold*). auto: when training on the CPU; false when speed "
                            "matters more than RAM.")
    activations: ActivationsConfig = Field(
        default_factory=ActivationsConfig,
        description="How activations are held between forward and backward (keep, recompute, or stored on NVMe) "
                    "and how the loss is chunked; see the activations.* rows.")

    @field_validator("host_memory_budget")
    @classmethod
    def _check_budget(cls, value):
        parse_host_budget(value)
        return value

    @field_validator("optimizer_chunk_numel")
    @classmethod
    def _check_auto_or_int(cls, value, info):
        if isinstance(value, str):
            if value != "auto":
                raise ValueError(f"expected 'auto' or an integer, got '{value}'")
            return value
        if isinstance(value, bool) or value < 0:
            raise ValueError(f"expected 'auto' or a non-negative integer, got {value}")
        if info.field_name == "optimizer_chunk_numel" and value < 1024:
            raise ValueError(f"expected 'auto' or at least 1024 elements, got {value}")
        return value

    @field_validator("retention_budget")
    @classmethod
    def _check_retention(cls, value):
        parse_retention(value)
        return value

    @field_validator("malloc_mmap_threshold")
    @classmethod
    def _check_mmap_threshold(cls, value):
        parse_mmap_threshold(value)
        return value

    @field_validator("block_size", "queue_depth", mode="before")
    @classmethod
    def _check_io(cls, value, info):
        # "auto" (the default) is told apart from a number the user wrote: only "auto" takes the tuned choice.
        # Before pydantic's own parsing, which would read true as 1.
        low, high = (4 * KiB, 64 * MiB) if info.field_name == "block_size" else (1, 4096)
        if isinstance(value, str) and value != "auto" and info.field_name == "block_size":
            try:   # a size, as host_memory_budget takes it: "1MiB", "256KiB", "4M"
                value = parse_size(value, "block_size")
            except ValueError:
                raise ValueError(f"expected 'auto', a size such as '1MiB', or an integer from {low} to {high}, "
                                 f"got '{value}'") from None
        if isinstance(value, str):
            if value != "auto":
                raise ValueError(f"expected 'auto' or an integer from {low} to {high}, got '{value}'")
            return value
        if not isinstance(value, (int, float)):
            return value                    # pydantic names the type it expected
        if isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"expected 'auto' or an integer from {low} to {high}, got {value}")
        if info.field_name == "block_size" and value % ALIGN:
            raise ValueError(f"block_size must be a multiple of {ALIGN} bytes (O_DIRECT), got {value}")
        return value


# 'auto' optimizer chunks: small enough that several fit in the host budget at once (the step keeps
# reads ahead and writes behind in flight), large enough that each read and write is a long sequential
# request (at least 3 MiB of master and moments).
AUTO_CHUNK_MIN = 1 << 18
AUTO_CHUNK_MAX = 1 << 25


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
    retention_budget: int = 0     # bytes
    malloc_mmap_threshold: int = MiB   # bytes; 0: glibc's dynamic threshold
    trim_heap: Union[bool, str] = "auto"   # "auto": when training on the CPU (SwapRuntime decides)
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
    def from_block(cls, block: Union[Dict[str, Any], AidaptivConfig], ram_bytes: Optional[int] = None,
                   local_ranks: Optional[int] = None) -> "SwapSettings":
        """Resolve a block (a dict, or one pydantic already parsed) that names its ``nvme_path``.

        ``ram_bytes`` is the memory this node may use; it is read (:func:`total_ram_bytes`, which reads
        the cgroup files) only when the budget is a share of RAM and it is not given. ``local_ranks`` (the
        ranks on this node, :func:`local_rank_count` when not given) splits a per-node budget; the result is
        this rank's share. Raises :class:`ConfigError` for a block that does not parse or has no
        ``nvme_path``."""
        cfg = block if isinstance(block, AidaptivConfig) else _parse_block(block)
        if not cfg.nvme_path:
            raise ConfigError([_NVME_PATH_REQUIRED])
        nbytes = _budget_bytes(cfg.host_memory_budget, ram_bytes, local_ranks)
        chunk = cfg.optimizer_chunk_numel
        if chunk == "auto":
            chunk = max(AUTO_CHUNK_MIN, min(AUTO_CHUNK_MAX, nbytes // 512))
        from aidaptiv_ds.io_tuning import resolve_io
        path = os.path.abspath(cfg.nvme_path)
        auto = lambda v: None if v == "auto" else v
        block, depth, block_source, depth_source = resolve_io(path, auto(cfg.block_size), auto(cfg.queue_depth))
        same = cfg.model_dump(exclude={"enabled", "nvme_path", "host_memory_budget", "optimizer_chunk_numel",
                                       "retention_budget", "block_size", "queue_depth", "malloc_mmap_threshold"})
        return cls(nvme_path=path, host_budget_bytes=nbytes, optimizer_chunk_numel=chunk, block_size=block,
                   queue_depth=depth, block_size_source=block_source, queue_depth_source=depth_source,
                   retention_budget=parse_retention(cfg.retention_budget),
                   malloc_mmap_threshold=parse_mmap_threshold(cfg.malloc_mmap_threshold), **same)

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


def _budget_bytes(host_memory_budget, ram_bytes: Optional[int], local_ranks: Optional[int] = None) -> int:
    """One rank's budget in bytes: a share of RAM is a share of ``ram_bytes`` (read here when None), and a
    per-node amount is split between ``local_ranks`` (read from the launcher's environment when None)."""
    nbytes, fraction, scope = parse_host_budget(host_memory_budget)
    if fraction is not None:
        nbytes = int(fraction * (ram_bytes if ram_bytes is not None else total_ram_bytes()))
    if scope == PER_NODE:
        nbytes //= local_ranks or local_rank_count()
    return nbytes


def memlock_limit() -> Optional[int]:
    """The locked-memory limit (ulimit -l) in bytes that mlock and io_uring buffer registration are held to,
    or None when they are not (unlimited, or the process has CAP_IPC_LOCK)."""
    import resource
    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        if int(caps, 16) & (1 << 14):  # CAP_IPC_LOCK
            return None
    except (OSError, ValueError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def check_host_budget(cfg: AidaptivConfig, ram_bytes: int, local_ranks: Optional[int] = None) -> List[str]:
    """Problems of the budget as the node sees it (all its ranks together), before anything is pinned.

    Refused: a total over the node's RAM (the ranks would be killed or swap). Warned about, not refused: a
    total over the locked-memory limit, since nothing fails then; the pool falls back to unlocked memory and
    io_uring to unregistered buffers, which only costs speed (mlock counts a rank's pool against the limit;
    io_uring counts every registration of the user together)."""
    ranks = local_ranks or local_rank_count()
    per_rank = _budget_bytes(cfg.host_memory_budget, ram_bytes, ranks)
    problems = []
    retention = parse_retention(cfg.retention_budget)
    if retention >= per_rank:
        # The exact room (the budget less the swapper's minimum) is known once the model is: the run's plan
        # checks it before training. A retention as large as the whole budget can never fit.
        problems.append(
            f"{BLOCK}.retention_budget {cfg.retention_budget!r} ({retention / MiB:.1f} MiB) is not below this "
            f"rank's host_memory_budget ({per_rank / MiB:.1f} MiB), which it is part of: lower it (the run's plan "
            "says how much fits beyond the swapper's minimum)")
    node = per_rank * ranks
    if node > ram_bytes:
        share = f"each of the {ranks} ranks on this node {per_rank / GiB:.2f} GiB, {node / GiB:.2f} GiB together" \
            if ranks > 1 else f"{per_rank / GiB:.2f} GiB"
        return problems + [
            f"{BLOCK}.host_memory_budget {cfg.host_memory_budget!r} gives {share}, but this node may use "
            f"{ram_bytes / GiB:.2f} GiB of RAM (the machine's, or its cgroup's limit): lower it (a share such "
            "as \"25%\" or a size per node such as \"64GiB/node\" is split between the node's ranks)"]
    limit = memlock_limit()
    pinned = node if cfg.register_buffers else per_rank
    if limit is not None and pinned > limit and os.environ.get("LOCAL_RANK", "0") == "0":
        import logging
        logging.getLogger(__name__).warning(
            "aidaptiv: host_memory_budget lets %s pin up to %.2f GiB but the locked-memory limit (ulimit -l) is "
            "%.2f MiB: pools over it run unlocked and io_uring without fixed buffers (slower, nothing lost); "
            "raise it (memlock in /etc/security/limits.conf, LimitMEMLOCK= for systemd, --ulimit memlock=-1 "
            "for docker)", f"the {ranks} ranks on this node" if ranks > 1 else "this rank", pinned / GiB,
            limit / MiB)
    return problems


_NVME_PATH_REQUIRED = f"{BLOCK}.nvme_path is required when {BLOCK}.enabled is true: a directory on NVMe"


def _pydantic_problems(err: ValidationError) -> List[str]:
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        where = f"{BLOCK}.{loc}" if loc else BLOCK
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            model = ActivationsConfig if len(e["loc"]) > 1 and e["loc"][0] == "activations" else AidaptivConfig
            fields = ", ".join(sorted(model.model_fields))
            msg = f"unknown setting (known: {fields})"
        out.append(f"{where}: {msg}")
    return out


def _parse_block(block) -> AidaptivConfig:
    if not isinstance(block, dict):
        raise ConfigError([f"{BLOCK} must be an object, got {type(block).__name__}"])
    try:
        return AidaptivConfig.model_validate(block)
    except ValidationError as err:
        raise ConfigError(_pydantic_problems(err)) from None


def block_of(ds_config) -> Optional[Dict[str, Any]]:
    """The block from a config dict or from DeepSpeed's parsed config object (which keeps the raw dict)."""
    if not isinstance(ds_config, dict):
        ds_config = getattr(ds_config, "_param_dict", None)
    return ds_config.get(BLOCK) if isinstance(ds_config, dict) else None


def is_enabled(ds_config: Dict[str, Any]) -> bool:
    block = block_of(ds_config)
    return isinstance(block, dict) and bool(block.get("enabled", False))


def _check_nvme_path(path: str, needed_bytes: Optional[int]) -> List[str]:
    problems = []
    if not os.path.isdir(path):
        problems.append(f"{BLOCK}.nvme_path {path} does not exist: create it on an NVMe filesystem you own "
                        f"(mkdir -p {path}) or point nvme_path at one")
        return problems
    if not os.access(path, os.W_OK | os.X_OK):
        problems.append(f"{BLOCK}.nvme_path {path} is not writable (EACCES): choose a directory you own or fix its "
                        "permissions")
        return problems
    try:
        import subprocess
        fstype = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except Exception:  # stat missing: the engine will report O_DIRECT failures with the file name
        fstype = ""
    if fstype in ("tmpfs", "ramfs"):
        problems.append(f"{BLOCK}.nvme_path {path} is on {fstype}, which is RAM and does not support O_DIRECT: "
                        "choose a directory on an NVMe (or other block-device) filesystem")
    return problems + _free_space_problems(path, needed_bytes)


def _free_space_problems(path: str, needed_bytes: Optional[int]) -> List[str]:
    if needed_bytes is None:
        return []
    free = shutil.disk_usage(path).free
    if free >= needed_bytes:
        return []
    return [f"{BLOCK}.nvme_path {path} has {free / GiB:.2f} GiB free but the model state needs "
            f"{needed_bytes / GiB:.2f} GiB more on this node (all its ranks swap to this disk): free space or choose "
            "a larger disk"]


def validate(ds_config: Dict[str, Any], needed_bytes: Optional[int] = None,
             check_paths: bool = True) -> Optional[SwapSettings]:
    """Validate the aidaptiv block and what it needs from the rest of the config, and resolve it.

    Returns the resolved settings, or None when there is no enabled block. Raises :class:`ConfigError`
    listing every problem. ``needed_bytes`` (swap bytes the model state of this node's ranks still needs), when
    known, is checked
    against the free space of ``nvme_path``. The machine's memory (and its cgroup limit) is read once.
    """
    block = block_of(ds_config)
    if block is None:
        return None
    problems: List[str] = []
    try:
        cfg = _parse_block(block)
    except ConfigError as err:
        if not isinstance(block, dict):
            raise
        problems.extend(err.problems)
        cfg = None
    if cfg is not None and not cfg.enabled:
        return None

    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage != 3:
        problems.append(f"zero_optimization.stage is {stage} but aidaptiv swaps ZeRO-3 partitions: set "
                        "\"zero_optimization\": {\"stage\": 3}")
    for section in ("offload_param", "offload_optimizer"):
        sub = zero.get(section)
        if sub is None:
            continue
        device = (sub or {}).get("device", "none")
        if device not in ("nvme", "none", None):
            problems.append(f"zero_optimization.{section}.device is '{device}' but aidaptiv manages offload to NVMe "
                            f"itself: remove zero_optimization.{section} (or set its device to \"nvme\")")
    if zero.get("offload_param", {}) and zero.get("offload_param", {}).get("device") == "nvme" \
            and cfg is not None and cfg.nvme_path and zero["offload_param"].get("nvme_path") not in (None, cfg.nvme_path):
        problems.append(f"zero_optimization.offload_param.nvme_path ({zero['offload_param']['nvme_path']}) differs "
                        f"from {BLOCK}.nvme_path ({cfg.nvme_path}): keep one, the aidaptiv one is used")
    for key in ("fp16",):
        if precision_enabled(ds_config, key):
            problems.append(f"{key}.enabled is true: aidaptiv supports fp32 and bf16 training; use \"bf16\": "
                            "{\"enabled\": true} for mixed precision")

    ram = None
    if cfg is not None:
        if not cfg.nvme_path:
            problems.append(_NVME_PATH_REQUIRED)
        elif check_paths:
            problems.extend(_check_nvme_path(cfg.nvme_path, needed_bytes))
        ram = total_ram_bytes()
        problems.extend(check_host_budget(cfg, ram))
    if problems:
        raise ConfigError(problems)
    return SwapSettings.from_block(cfg, ram)


# Reduce-bucket size (elements, 64 MiB of fp32) that small budgets grow their buckets towards.
LIMIT_FLOOR = 1 << 24
# The same when training on the CPU (8 MiB of fp32), where the bucket itself is host memory besides the budget.
HOST_BUCKET_FLOOR = 1 << 21


# Whether training runs on the CPU: DeepSpeed's accelerator, which only the ZeRO-3 binding may ask
# (the aidaptiv_ds.zero3 package registers compat.training_on_host here when it is imported). Until then: no.
_host_probe: Callable[[], bool] = lambda: False


def set_host_probe(probe: Callable[[], bool]) -> None:
    global _host_probe
    _host_probe = probe


def training_on_host() -> bool:
    """Whether DeepSpeed trains on the CPU, so that its device buffers are host memory (see _host_probe)."""
    return bool(_host_probe())


def reduce_bucket_cap(budget: int, on_host: bool) -> int:
    """The most elements DeepSpeed's reduce bucket may hold under a host budget of ``budget`` bytes.

    ZeRO-3 holds views of every gradient partition of a reduce bucket until the whole bucket is partitioned,
    so a bucket's gradients cannot leave the pool before then: buckets stay within an eighth of the budget
    (DeepSpeed's default, 5e8 elements, is the whole of most models). Every bucket is one collective and many
    small ones slow the backward, so a small budget may give buckets up to a quarter of itself until they
    reach LIMIT_FLOOR elements; never more, or the gradients DeepSpeed holds crowd out the layer groups.
    On the CPU the bucket's flat buffer (contiguous_gradients) is one more host allocation outside the pool,
    held for the whole run, and a collective on one node is cheap: a 32nd of the budget (at least
    HOST_BUCKET_FLOOR elements, at most a quarter). Measured on tiny (examples/zero_init_train.py, fp32, 2 x 64,
    budget 662 MiB, 14 steps): the eighth's 82.7 MiB bucket peaked at 1342-1350 MiB RSS (3 runs), the 32nd's
    20.7 MiB at 1277-1297 (4 runs), with median steps of 0.87-0.94 s and 0.82-0.91 s.
    """
    if on_host:
        return max(1, budget // 32 // 4, min(HOST_BUCKET_FLOOR, budget // 4 // 4))
    return max(1, budget // 8 // 4, min(LIMIT_FLOOR, budget // 4 // 4))

# The ZeRO-3 settings the translation bounds by the host budget or sets itself. "auto" in any of them (the
# Hugging Face Trainer's documented configs leave it there until the trainer fills it) means "ours": the
# value the translation chooses when the setting is absent. (The persistence threshold and sub-group size
# are ours whatever the config says.)
BOUNDED = ("reduce_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
           "stage3_param_persistence_threshold", "sub_group_size")


def auto_keys(ds_config: Dict[str, Any]) -> frozenset:
    """The :data:`BOUNDED` settings of ``zero_optimization`` that say "auto"."""
    zero = ds_config.get("zero_optimization") or {}
    return frozenset(k for k in BOUNDED if zero.get(k) == "auto")


def _number(zero: Dict[str, Any], key: str, ours, auto: frozenset):
    """The user's value of a bounded setting, or ``ours`` when it is absent or left to us ("auto")."""
    value = zero.get(key)
    return ours if value is None or value == "auto" or key in auto else value


def to_deepspeed_config(ds_config: Dict[str, Any], settings: SwapSettings, auto: frozenset = frozenset(),
                        on_host: Optional[bool] = None) -> Dict[str, Any]:
    """Return a copy of ``ds_config`` with the ZeRO-3 settings that route DeepSpeed through our swappers,
    and with the block replaced by ``settings.block()`` (registered, so :func:`settings_for` finds
    ``settings`` from DeepSpeed's config object).

    DeepSpeed takes its NVMe code paths only when offload devices say "nvme"; our classes replace the
    swappers behind those paths, so DeepSpeed's own buffer_count/buffer_size/max_in_cpu values below are
    placeholders it validates but we do not use. A :data:`BOUNDED` setting that says "auto", or is named in
    ``auto`` (it said "auto" when this config was first seen, and a trainer has filled it since: see
    :func:`resolve`), gets our value; a number is capped by the budget. ``on_host``: whether training runs
    on the CPU (None: :func:`training_on_host`), which bounds the reduce bucket further.
    """
    out = copy.deepcopy(ds_config)
    auto = frozenset(auto) | auto_keys(out)
    budget = settings.host_budget_bytes
    zero = out.setdefault("zero_optimization", {})
    zero["stage"] = 3
    zero["offload_param"] = {"device": "nvme", "nvme_path": settings.nvme_path, "pin_memory": False,
                             "buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 0}
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": settings.nvme_path, "pin_memory": False,
                                 "pipeline_read": False, "pipeline_write": False, "fast_init": False,
                                 "buffer_count": 4}
    # Small parameters are swapped like the rest; they travel inside their layer group. Any threshold,
    # the user's or the 10 x hidden a trainer fills in for "auto", is replaced: DeepSpeed gathers a
    # persistent parameter again right after every step and never releases its partition, which is a view
    # into its layer group's slot, so each group holding one would stay in use for the whole run and the
    # budget's slots run out in the second forward (HostBudgetError, reproduced with HF's value).
    zero["stage3_param_persistence_threshold"] = 0
    # Gathered parameters keep their partitions (views into our layer-group buffers) in host memory until
    # DeepSpeed releases them; on one rank on CPU the gathered parameter is that very buffer. DeepSpeed's
    # defaults (1e9 elements) keep every parameter live across the forward/backward turn, which ignores
    # the budget: cap both to a quarter of it. Groups released early stay cached while memory allows.
    live = max(1, budget // 4 // dtype_bytes(dtype_name(out)))
    zero["stage3_max_live_parameters"] = int(min(_number(zero, "stage3_max_live_parameters", live, auto), live))
    zero["stage3_max_reuse_distance"] = int(min(_number(zero, "stage3_max_reuse_distance", 0, auto), live))
    # Reduce buckets bounded by the budget, and on the CPU by the host memory their buffer takes.
    bucket = reduce_bucket_cap(budget, training_on_host() if on_host is None else on_host)
    zero["reduce_bucket_size"] = int(min(_number(zero, "reduce_bucket_size", 500_000_000, auto), bucket))
    # DeepSpeed's own NVMe prefetch is replaced by our layer-group prefetch; its all-gather prefetch of
    # partitions already in memory stays.
    zero["sub_group_size"] = settings.optimizer_chunk_numel
    # Gradients are accumulated in fp32 in our per-sub-group buffers, which are also what the optimizer
    # steps on: no conversion copy at the accumulation boundary.
    out.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    out[BLOCK] = settings.block()
    _settings_by_block.setdefault(_key(out[BLOCK]), settings)
    return out


def _key(obj) -> str:
    """A config's content as one string (the key of the registries below)."""
    return json.dumps(obj, sort_keys=True, default=str)


# Settings by the resolved block a translated config carries: DeepSpeed builds our parameter swapper from
# nothing but its config object, whose raw dict still holds that block.
_settings_by_block: Dict[str, SwapSettings] = {}
# Configs resolved in this process, by content and working directory (a relative nvme_path depends on it),
# with their translation: zero_init and initialize get the same config (train, the HF Trainer), and a
# translated config may come back; the key of each translation maps to the same pair.
_resolved: Dict[str, Tuple[Dict[str, Any], SwapSettings]] = {}

# Where the Hugging Face Trainer and accelerate write between building the model under zero.Init, which
# gets the config with "auto" still in it, and deepspeed.initialize, which gets it filled in
# (transformers' HfTrainerDeepSpeedConfig.trainer_config_process/_finalize; accelerate's DeepSpeedPlugin,
# whose zero.Init copy also sets the batch to 1, and Accelerator._prepare_deepspeed).
TRAINER_FILLED = (
    "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps", "fp16.enabled", "bf16.enabled", "steps_per_print",
    "zero_allow_untested_optimizer", "checkpoint.use_node_local_storage",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save")
# Per config less TRAINER_FILLED (and working directory): the BOUNDED settings that said "auto" when it was
# first resolved, and its settings. The trainer's numbers for them (hidden x hidden for reduce_bucket_size,
# 10 x hidden for the persistence threshold) are not the user's, so they get our values as the autos did.
_autos_by_shape: Dict[str, Tuple[frozenset, SwapSettings]] = {}


def _without(cfg: Dict[str, Any], paths) -> Dict[str, Any]:
    """A copy of ``cfg`` without the dotted ``paths``, and without the sections that leaves empty."""
    out = copy.deepcopy(cfg)
    for path in paths:
        names = path.split(".")
        chain = [out]
        for name in names[:-1]:
            section = chain[-1].get(name)
            if not isinstance(section, dict):
                break
            chain.append(section)
        else:
            chain[-1].pop(names[-1], None)
            for depth in range(len(names) - 1, 0, -1):
                if chain[depth]:
                    break
                chain[depth - 1].pop(names[depth - 1])
    return out


def resolve(ds_config: Dict[str, Any], needed_bytes: Optional[int] = None
            ) -> Tuple[Dict[str, Any], Optional[SwapSettings]]:
    """(the config DeepSpeed should get, its resolved settings); ``(ds_config, None)`` without an enabled
    block.

    Validation, resolution and translation happen once per config in a process: a config seen before, or
    the translation of one, gets the same settings object and a copy of the same translation. A config
    that differs from one seen before only where trainers fill in "auto" (:data:`TRAINER_FILLED`: the HF
    Trainer and accelerate build the model under ``zero.Init`` with the autos and call
    ``deepspeed.initialize`` with them filled) is validated again, gets the same settings, and its
    :data:`BOUNDED` settings that were "auto" get our values again.
    ``needed_bytes`` (swap bytes the model state of this node's ranks still needs), when given, is checked
    against the free space of ``nvme_path`` on every call, since the model may be known only on the second one.
    """
    cwd = os.getcwd()
    key = _key([cwd, ds_config])
    hit = _resolved.get(key)
    if hit is None:
        settings = validate(ds_config, needed_bytes=needed_bytes)
        if settings is None:
            return ds_config, None
        shape = _key([cwd, _without(ds_config, TRAINER_FILLED)])
        autos = auto_keys(ds_config)
        earlier = _autos_by_shape.get(shape)
        if earlier is not None:
            autos |= earlier[0]
            if earlier[1] == settings:
                settings = earlier[1]
        if autos:
            _autos_by_shape[shape] = (autos, settings)
        hit = (to_deepspeed_config(ds_config, settings, autos), settings)
        _resolved[key] = hit
        _resolved[_key([cwd, hit[0]])] = hit
    else:
        problems = _free_space_problems(hit[1].nvme_path, needed_bytes)
        if problems:
            raise ConfigError(problems)
    return copy.deepcopy(hit[0]), hit[1]


def settings_for(ds_config) -> Optional[SwapSettings]:
    """The settings of a config dict or of DeepSpeed's config object; None without an enabled block.

    A block that came through :func:`resolve` maps to the settings resolved then. One that did not
    (DeepSpeed called directly with an enabled block, the swappers installed by an earlier run) is
    resolved here, once."""
    block = block_of(ds_config)
    if not (isinstance(block, dict) and block.get("enabled")):
        return None
    key = _key(block)
    settings = _settings_by_block.get(key)
    if settings is None:
        settings = _settings_by_block.setdefault(key, SwapSettings.from_block(block))
    return settings
