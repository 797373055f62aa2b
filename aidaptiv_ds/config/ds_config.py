"""The DeepSpeed JSON a training run is launched with: read it, apply command-line overrides, check it.

:func:`load` is the package's one reader of DeepSpeed configs (a dict, a JSON/hjson file, or None), and
:class:`ConfigError` the one error for a config that cannot run, whichever part of it is wrong. This module
only edits the DeepSpeed dict; our own ``"aidaptiv"`` block is validated by :mod:`aidaptiv_ds.config`. It
imports no torch and nothing of ours, so the harness may import its names (``BACKENDS``).
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Iterable, Optional, Union

# The four configurations we compare, in report column order; each has its ds_configs/<backend>.json, and
# backend() tells which one a config is.
BACKENDS = ("zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv")
DTYPES = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A config that cannot be run as given; ``problems`` lists every problem found, not just the first.

    Raised for the DeepSpeed config, for our ``"aidaptiv"`` block and for a host budget too small for the
    model: one type, so that callers catch one thing and users read one format."""

    def __init__(self, problems: Union[str, Iterable[str]], source: str = "DeepSpeed config"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the {source}:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


def load(config, what: str = "DeepSpeed config") -> Optional[dict]:
    """A DeepSpeed config given as a dict (returned as it is), a path to strict JSON or to hjson (which
    DeepSpeed itself accepts), or None (returned as None). ``what`` names the config in errors (the CLI
    passes "--config")."""
    if config is None or isinstance(config, dict):
        return config
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path} does not exist: give a DeepSpeed JSON file (see ds_configs/)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        try:
            import hjson
        except ImportError:
            raise ConfigError(f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        try:
            cfg = json.loads(json.dumps(hjson.loads(text)))
        except Exception as e2:  # hjson raises its own HjsonDecodeError
            raise ConfigError(f"{what} {path} is neither JSON nor hjson ({e2})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{what} {path} must hold a JSON object, not {type(cfg).__name__}")
    return cfg


def _zero(cfg: dict) -> dict:
    return cfg.get("zero_optimization") or {}


def _offload_device(cfg: dict, key: str) -> str:
    block = _zero(cfg).get(key) or {}
    return str(block.get("device", "none")).lower()


def backend(cfg: dict) -> str:
    """Which of our four configurations this is: aidaptiv, zero_infinity, zero3_cpu_offload, zero3
    (or zeroN for other stages)."""
    block = cfg.get("aidaptiv")
    if isinstance(block, dict) and block.get("enabled", False):  # "enabled": false runs stock ZeRO-3
        return "aidaptiv"
    stage = int(_zero(cfg).get("stage", 0))
    if stage != 3:
        return f"zero{stage}"
    devices = {_offload_device(cfg, "offload_param"), _offload_device(cfg, "offload_optimizer")}
    if "nvme" in devices:
        return "zero_infinity"
    if "cpu" in devices:
        return "zero3_cpu_offload"
    return "zero3"


def precision_enabled(cfg: dict, section: str) -> bool:
    """Whether the "bf16" or "fp16" section is on, as DeepSpeed reads it: "auto" (which the Hugging Face
    Trainer and accelerate replace before training) counts as off, DeepSpeed's default."""
    value = (cfg.get(section) or {}).get("enabled")
    return value != "auto" and bool(value)


def dtype_name(cfg: dict) -> str:
    if precision_enabled(cfg, "bf16"):
        return "bf16"
    if precision_enabled(cfg, "fp16"):
        return "fp16"
    return "fp32"


def torch_dtype(cfg: dict):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name(cfg)]


def _find_auto(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _find_auto(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _find_auto(v, f"{path}[{i}]")
    elif obj == "auto":
        yield path


def nvme_blocks(cfg: dict) -> list[dict]:
    """Every block of the config that carries an nvme_path (DeepSpeed offload blocks, our "aidaptiv" block)."""
    blocks = [(_zero(cfg).get(k) or {}) for k in ("offload_param", "offload_optimizer")]
    if isinstance(cfg.get("aidaptiv"), dict):
        blocks.append(cfg["aidaptiv"])
    return [b for b in blocks if "nvme_path" in b]


def apply_overrides(
    cfg: dict,
    *,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    lr: float | None = None,
    nvme_path: str | None = None,
    dtype: str | None = None,
    host_budget: str | None = None,
) -> dict:
    """A copy of ``cfg`` with the command line's choices applied.

    train_batch_size is removed whenever micro-batch or accumulation are given (DeepSpeed recomputes it as
    micro x accumulation x world size, so the same file works for 1 or 2 ranks). ``lr`` sets the optimizer's
    lr and, if a scheduler has a warmup_max_lr, that too. ``nvme_path`` replaces nvme_path wherever the config
    has one. ``dtype`` switches the bf16/fp16 blocks. ``host_budget`` sets the "aidaptiv" block's
    host_memory_budget (an error for configs without one).
    """
    cfg = copy.deepcopy(cfg)
    if micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = int(micro_batch)
    if grad_accum is not None:
        cfg["gradient_accumulation_steps"] = int(grad_accum)
    if micro_batch is not None or grad_accum is not None:
        cfg.pop("train_batch_size", None)
    if lr is not None:
        opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
        opt.setdefault("params", {})["lr"] = float(lr)
        sched_params = (cfg.get("scheduler") or {}).get("params") or {}
        if "warmup_max_lr" in sched_params:
            sched_params["warmup_max_lr"] = float(lr)
    if nvme_path is not None:
        for block in nvme_blocks(cfg):
            block["nvme_path"] = nvme_path
    if host_budget is not None:
        block = cfg.get("aidaptiv")
        if not isinstance(block, dict):
            raise ConfigError(
                '`host_budget` applies to the aidaptiv swapper, but the config has no "aidaptiv" '
                "block: use ds_configs/aidaptiv.json (or drop `host_budget`)"
            )
        block["host_memory_budget"] = int(host_budget) if str(host_budget).isdigit() else host_budget
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError(f"`dtype` {dtype} is not one of {', '.join(DTYPES)}")
        cfg["bf16"] = {**(cfg.get("bf16") or {}), "enabled": dtype == "bf16"}
        cfg["fp16"] = {**(cfg.get("fp16") or {}), "enabled": dtype == "fp16"}
    return cfg


def lookalike_blocks(ds_config) -> list:
    """Top-level keys that look like a misspelt ``"aidaptiv"`` (DeepSpeed ignores unknown top-level keys, so
    such a block would silently run in-memory ZeRO-3): one problem line each."""
    import difflib

    if not isinstance(ds_config, dict) or "aidaptiv" in ds_config:
        return []
    out = []
    for key in ds_config:
        name = str(key)
        if difflib.SequenceMatcher(None, name.lower(), "aidaptiv").ratio() >= 0.75 or name.lower().startswith("aidapt"):
            out.append(
                f'the config has a top-level "{name}" but no "aidaptiv": DeepSpeed ignores unknown keys, so it would '
                'train without aidaptiv; rename it to "aidaptiv"'
            )
    return out


_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
LR_KEY = "optimizer.params.lr"


def number_problems(cfg: dict, skip: Iterable[str] = ()) -> list[str]:
    """The config's batch sizes (each a whole number of at least 1) and optimizer lr (finite, 0 or more), one
    sentence each: DeepSpeed takes a 0 or a NaN and fails mid-run (a KeyError, a division by zero) or trains
    nothing without a word. ``skip``: keys the command line set (it checks its own values); "auto" is the
    Hugging Face Trainer's placeholder, which :func:`check` reports."""
    problems = []
    for key in _BATCH_KEYS:
        value = cfg.get(key)
        if key in skip or key not in cfg or value == "auto":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key} {value!r} must be a whole number of at least 1")
    lr = ((cfg.get("optimizer") or {}).get("params") or {}).get("lr")
    if LR_KEY not in skip and isinstance(lr, (int, float)) and not isinstance(lr, bool):
        if not (math.isfinite(lr) and lr >= 0):
            problems.append(f"{LR_KEY} {lr} must be a finite number, 0 or more (e.g. 1e-5)")
    return problems


def check(
    cfg: dict,
    *,
    world_size: int,
    largest_param_numel: int | None = None,
    model_name: str = "the model",
    cuda: bool = False,
) -> None:
    """Problems DeepSpeed would report late (an assert mid-step) or not at all, all at once."""
    problems = lookalike_blocks(cfg)
    # The aidaptiv block's own "auto" values (block_size, activations.policy, ...) are ours to resolve.
    autos = [p for p in _find_auto(cfg) if not p.startswith("aidaptiv.")]
    if autos:
        problems.append(
            f"values 'auto' at {', '.join(autos)} are filled by the Hugging Face Trainer (and TRL, "
            "accelerate), which this job does not use: write numbers (ds_configs/aidaptiv.json has them)"
        )
    if "train_micro_batch_size_per_gpu" not in cfg and "train_batch_size" not in cfg:
        problems.append(
            "neither train_micro_batch_size_per_gpu nor train_batch_size is set: give "
            "train_micro_batch_size_per_gpu (or `micro_batch`)"
        )
    problems += number_problems(cfg)
    if dtype_name(cfg) == "fp16" and not cuda:
        problems.append("fp16 training needs CUDA: on CPU use fp32 or bf16 (`dtype`)")
    for b in nvme_blocks(cfg):
        if not b.get("nvme_path"):
            problems.append("an nvme_path is empty: set it in the config or pass `nvme_path`")
    param = _zero(cfg).get("offload_param") or {}
    if str(param.get("device", "none")).lower() == "nvme" and largest_param_numel:
        partition = math.ceil(largest_param_numel / max(1, world_size))
        buffer_size = int(float(param.get("buffer_size", 1e8)))
        if buffer_size < partition:
            problems.append(
                f"zero_optimization.offload_param.buffer_size {buffer_size} is smaller than the largest parameter "
                f"partition of {model_name} ({partition} elements with {world_size} rank(s)): DeepSpeed would assert "
                f"mid-step; raise buffer_size to at least {partition}"
            )
    if problems:
        raise ConfigError(problems)
