"""The ``"aidaptiv"`` block as the user writes it: pydantic models with bounds and a docstring per field,
the parsers of sizes, budgets, bandwidths and retention, and every problem of a block collected into one
:class:`~aidaptiv_ds.config.ds_config.ConfigError`."""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from aidaptiv_ds.common.sizes import ALIGN, KiB, MiB, parse_size
from aidaptiv_ds.config.ds_config import ConfigError
from aidaptiv_ds.engine.backend import Backend

BLOCK = "aidaptiv"


def parse_budget(value: Union[int, float, str]) -> Tuple[Optional[int], Optional[float]]:
    """Return (bytes, fraction_of_ram): an int is bytes, a float in (0, 1) or "N%" is a fraction of RAM,
    a string with a unit is bytes as :func:`aidaptiv_ds.common.sizes.parse_size` reads it ("4GB" decimal,
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
        raise ValueError(
            f"'{text}' is not a size: use bytes (268435456), a unit (256MiB, 4GB) or a share of RAM (25%)"
        ) from None
    if nbytes <= 0:
        raise ValueError(f"a byte budget must be positive, got {text}")
    return nbytes, None


PER_RANK, PER_NODE = "rank", "node"


def parse_mmap_threshold(value: Union[int, str]) -> int:
    """A ``malloc_mmap_threshold`` in bytes: 0, or a size up to glibc's 32 MiB limit."""
    from aidaptiv_ds.common.malloc_threshold import MAX_THRESHOLD

    nbytes = parse_retention(value)
    if nbytes > MAX_THRESHOLD:
        raise ValueError(f"{nbytes} bytes is above glibc's limit of 32MiB ({MAX_THRESHOLD} bytes)")
    return nbytes


def parse_retention(value: Union[int, str]) -> int:
    """A ``retention_budget`` in bytes (an int, or a size as :func:`aidaptiv_ds.common.sizes.parse_size` reads it).
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
            raise ValueError(
                "a share of RAM is a share of the node, split between its ranks: give it without "
                "'/rank', or give each rank a size ('16GiB/rank')"
            )
        return None, fraction, PER_NODE
    return nbytes, None, scope or PER_RANK


class ActivationsConfig(BaseModel):
    """How the activations a forward saves for its backward are held (the block's ``"activations"`` object);
    applied by :mod:`aidaptiv_ds.zero3.activations`."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["keep", "recompute", "nvme", "auto"] = Field(
        "keep",
        description="keep: activations stay in memory as the model saves them. recompute: gradient "
        "checkpointing of every transformer block (only each block's input is kept; the "
        "block is recomputed in the backward). nvme: recompute, and each block's input is "
        "written to this rank's swap space during the forward and read back, ahead of "
        "need, during the backward. auto: a plan per block from what the first training "
        "forward measures: keep the blocks the activation budget holds; store each other "
        "block's saved tensors on NVMe (no recompute) when writing and reading them takes "
        "less time than recomputing the block, else recompute it (see docs/DESIGN.md).",
    )
    loss_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Tokens per chunk of the LM head and loss: the full tokens x vocabulary logits "
        "and their gradient never exist at once (Llama, Qwen2 and Mistral models; "
        "the same loss). 0 computes the model's own unchunked loss.",
    )
    read_ahead: int = Field(
        2,
        ge=0,
        le=64,
        description="nvme and auto: stored activations read ahead of the "
        "backward (each in a staging buffer of the host budget).",
    )
    min_bytes: int = Field(
        64 * KiB, ge=0, description="nvme and auto: saved tensors smaller than this stay in memory (token ids, masks)."
    )
    budget: Union[int, str] = Field(
        "auto",
        description="auto only: memory the blocks' activations may hold (bytes or a size, '512MiB'). "
        "'auto': on CUDA half the GPU memory free when the plan is made (the other half "
        "for the backward's gradients and recompute); on CPU this rank's host_memory_budget "
        "(the activations live in ordinary memory beside it).",
    )
    nvme_bandwidth: Union[int, float, str] = Field(
        "auto",
        description="auto only: bytes/s the swap disk reads and writes activations at (a number, or a "
        "size per second such as '2GiB'). 'auto': the rates 'aidaptiv-ds plan --nvme-path' "
        "measured for this disk (its cache), else a short write and read-back through the "
        "engine when the plan is made.",
    )

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
            raise ValueError(
                f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to policy "
                f'"auto" only, but the policy is "{self.policy}": remove '
                f'{"them" if len(given) > 1 else "it"} or set the policy to "auto"'
            )
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


class AidaptivConfig(BaseModel):
    """Settings of the aidaptiv NVMe swapper (the ``"aidaptiv"`` block of a DeepSpeed config)."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    enabled: bool = Field(
        False,
        description="Turn the swapper on. When false the block is ignored and DeepSpeed runs exactly as configured.",
    )
    nvme_path: Optional[str] = Field(
        None,
        description="Directory for the swap space (one subfolder per rank). It must "
        "exist, be writable and sit on a filesystem that supports "
        "O_DIRECT (not tmpfs).",
    )
    backend: Backend = Field(
        Backend.AUTO,
        description="I/O backend: io_uring, posix (thread pool) or auto (io_uring, "
        "falling back to posix with a message).",
    )
    block_size: Union[int, str] = Field(
        "auto",
        description="Bytes per I/O piece (4 KiB to 64 MiB, a multiple of 4 KiB; a number or a size such as "
        "'1MiB'); a larger transfer is split "
        "into pieces of this size. 'auto': the choice of 'aidaptiv-ds plan --nvme-path' for this disk "
        "(an O_DIRECT sweep, cached per disk), or 1048576 when the disk was never swept.",
    )
    queue_depth: Union[int, str] = Field(
        "auto",
        description="I/O pieces in flight per engine (1 to 4096). 'auto': the choice of 'aidaptiv-ds plan "
        "--nvme-path' for this disk (with the block_size given, if one is), or 32 when the disk was "
        "never swept.",
    )
    io_threads: int = Field(4, ge=1, le=256, description="Threads of the posix backend.")
    register_buffers: bool = Field(
        True,
        description="Register the pinned pool with io_uring as fixed buffers "
        "(falls back to plain buffers when the memlock limit refuses).",
    )
    sqpoll: bool = Field(False, description="Use an io_uring submission-queue polling thread (costs a core).")
    host_memory_budget: Union[int, float, str] = Field(
        "25%",
        description="Host RAM for pinned staging buffers and the RAM cache tier, together. A share of RAM "
        "('25%' or a float in (0,1)) is a share of the node (or of its cgroup limit) for all its "
        "ranks together, split evenly between them (LOCAL_WORLD_SIZE, set by torchrun and "
        "accelerate; LOCAL_SIZE, set by the deepspeed launcher). A size is per rank ('16GiB', "
        "'16GiB/rank', or bytes as an int) or per node, split the same way ('64GiB/node'). A total "
        "over the node's RAM is refused; one over the locked-memory limit (ulimit -l) is warned "
        "about (the pool then works unlocked). The pool is sized from the model and never "
        "exceeds a rank's share.",
    )
    layer_group_size: int = Field(
        4,
        ge=1,
        le=1024,
        description="Transformer layers per group (at most): the "
        "unit of prefetch, contiguous on disk. Groups "
        "shrink when the budget cannot prefetch them.",
    )
    prefetch_depth: int = Field(
        1,
        ge=0,
        le=16,
        description="Layer groups read ahead of the one computing (at most: lowered, down to 0, when the "
        "budget cannot hold a slot of the largest group for each).",
    )
    optimizer_chunk_numel: Union[int, str] = Field(
        "auto",
        description="Elements per optimizer chunk (and DeepSpeed's sub_group_size): the unit of optimizer "
        "read-ahead and write-behind. 'auto' sizes it from the host budget.",
    )
    deferred_update: bool = Field(
        True,
        description="fp32 models: apply each parameter's optimizer update when "
        "the next forward fetches it (same result; the forward's "
        "read of the parameters serves the update, and the "
        "update's I/O overlaps forward compute).",
    )
    cache_optimizer_state: bool = Field(
        True,
        description="Keep optimizer sub-groups resident in the host budget's "
        "leftover (after staging); they then skip NVMe each step.",
    )
    keep_swap_files: bool = Field(
        False,
        description="Leave the swap files in place at exit (they are removed "
        "otherwise). Checkpoints never depend on them.",
    )
    retention_budget: Union[int, str] = Field(
        0,
        description="Host memory (inside host_memory_budget) that keeps the last layer groups of the forward "
        "resident until the backward has used them, so the backward does not read them from NVMe "
        "again: bytes or a size ('256MiB'), in whole layer-group slots; a run whose budget holds "
        "less beyond the swapper's minimum is refused, saying how much fits. 0: none beyond what "
        "the cache keeps by itself.",
    )
    malloc_mmap_threshold: Union[int, str] = Field(
        "1MiB",
        description="Fix glibc's mmap threshold at this size (bytes or a size, at most '32MiB'; 0 leaves "
        "glibc's dynamic threshold): host allocations above it are mapped on their own and "
        "returned to the system when freed. With glibc's default the threshold climbs to the "
        "size of the first large tensor freed, and later ones below it stay in the heap after "
        "they are freed, growing the process's RSS by hundreds of MiB over what is live "
        "(aidaptiv_ds/common/malloc_threshold.py). Set once per process, when the swapper starts. The cost is a fresh "
        "zero-filled mapping per large allocation: on the tiny preset on 2 CPU cores, untrimmed, "
        "1303 against 1437 MiB peak RSS for a 0.836 against 0.851 s step (bench/results/"
        "heap_settings/tiny); '128KiB' beside the heap trimming saves another 1-3% for steps 7-12% "
        "longer; 0 when speed matters more than RAM.",
    )
    trim_heap: Union[StrictBool, Literal["auto"]] = Field(
        "auto",
        description="Give the heap's free pages back to the system (glibc's malloc_trim) at the end of each "
        "forward, backward and optimizer step and as the backward enters each layer group. Tensors below the mmap threshold that are freed "
        "in an order leaving holes keep their pages resident otherwise: on the CPU, where "
        "activations and gradients are host memory, hundreds of MiB at the peak. On 2 CPU cores, "
        "small at 0.4 of its state: 2518 against 2742 MiB for a 3.610 against 3.553 s step; tiny "
        "at 0.6: 1227 against 1303 MiB for 0.949 against 0.836 s (medians of 3 interleaved runs, "
        "bench/results/heap_settings). auto: when training on the CPU; false when speed "
        "matters more than RAM.",
    )
    activations: ActivationsConfig = Field(
        default_factory=ActivationsConfig,
        description="How activations are held between forward and backward (keep, recompute, or stored on NVMe) "
        "and how the loss is chunked; see the activations.* rows.",
    )

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
            try:  # a size, as host_memory_budget takes it: "1MiB", "256KiB", "4M"
                value = parse_size(value, "block_size")
            except ValueError:
                raise ValueError(
                    f"expected 'auto', a size such as '1MiB', or an integer from {low} to {high}, got '{value}'"
                ) from None
        if isinstance(value, str):
            if value != "auto":
                raise ValueError(f"expected 'auto' or an integer from {low} to {high}, got '{value}'")
            return value
        if not isinstance(value, (int, float)):
            return value  # pydantic names the type it expected
        if isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"expected 'auto' or an integer from {low} to {high}, got {value}")
        if info.field_name == "block_size" and value % ALIGN:
            raise ValueError(f"block_size must be a multiple of {ALIGN} bytes (O_DIRECT), got {value}")
        return value


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
