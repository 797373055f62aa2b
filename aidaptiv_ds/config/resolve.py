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
import json
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

from aidaptiv_ds.common.sizes import GiB
from aidaptiv_ds.config import host
from aidaptiv_ds.config.ds_config import ConfigError, lookalike_blocks, precision_enabled
from aidaptiv_ds.config.schema import _NVME_PATH_REQUIRED, BLOCK, _parse_block, block_of
from aidaptiv_ds.config.settings import SwapSettings
from aidaptiv_ds.config.translate import auto_keys, to_deepspeed_config
from aidaptiv_ds.engine import machine  # by module: tests replace machine.total_ram_bytes


def _check_nvme_path(path: str, needed_bytes: Optional[int]) -> List[str]:
    """The swap folder rule every command applies (aidaptiv_ds.engine.disk.swap_folder_problem: it exists, on a
    disk that takes O_DIRECT, writable), then the free space the model state needs."""
    from aidaptiv_ds.engine.disk import swap_folder_problem

    problem = swap_folder_problem(path)
    if problem:
        return [f"{BLOCK}.nvme_path {problem}"]
    return _free_space_problems(path, needed_bytes)


def _free_space_problems(path: str, needed_bytes: Optional[int]) -> List[str]:
    if needed_bytes is None:
        return []
    free = shutil.disk_usage(path).free
    if free >= needed_bytes:
        return []
    return [
        f"{BLOCK}.nvme_path {path} has {free / GiB:.2f} GiB free but the model state needs "
        f"{needed_bytes / GiB:.2f} GiB more on this node (all its ranks swap to this disk): free space or choose "
        "a larger disk"
    ]


def validate(
    ds_config: Dict[str, Any], needed_bytes: Optional[int] = None, check_paths: bool = True
) -> Optional[SwapSettings]:
    """Validate the aidaptiv block and what it needs from the rest of the config, and resolve it.

    Returns the resolved settings, or None when there is no enabled block. Raises :class:`ConfigError`
    listing every problem. ``needed_bytes`` (swap bytes the model state of this node's ranks still needs), when
    known, is checked
    against the free space of ``nvme_path``. The machine's memory (and its cgroup limit) is read once.
    """
    block = block_of(ds_config)
    if block is None:
        misspelt = lookalike_blocks(ds_config)
        if misspelt:
            raise ConfigError(misspelt)
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
        problems.append(
            f"zero_optimization.stage is {stage} but aidaptiv swaps ZeRO-3 partitions: set "
            '"zero_optimization": {"stage": 3}'
        )
    for section in ("offload_param", "offload_optimizer"):
        sub = zero.get(section)
        if sub is None:
            continue
        device = (sub or {}).get("device", "none")
        if device not in ("nvme", "none", None):
            problems.append(
                f"zero_optimization.{section}.device is '{device}' but aidaptiv manages offload to NVMe "
                f'itself: remove zero_optimization.{section} (or set its device to "nvme")'
            )
    if (
        zero.get("offload_param", {})
        and zero.get("offload_param", {}).get("device") == "nvme"
        and cfg is not None
        and cfg.nvme_path
        and zero["offload_param"].get("nvme_path") not in (None, cfg.nvme_path)
    ):
        problems.append(
            f"zero_optimization.offload_param.nvme_path ({zero['offload_param']['nvme_path']}) differs "
            f"from {BLOCK}.nvme_path ({cfg.nvme_path}): keep one, the aidaptiv one is used"
        )
    for key in ("fp16",):
        if precision_enabled(ds_config, key):
            problems.append(
                f'{key}.enabled is true: aidaptiv supports fp32 and bf16 training; use "bf16": '
                '{"enabled": true} for mixed precision'
            )

    ram = None
    if cfg is not None:
        if not cfg.nvme_path:
            problems.append(_NVME_PATH_REQUIRED)
        elif check_paths:
            problems.extend(_check_nvme_path(cfg.nvme_path, needed_bytes))
        ram = machine.total_ram_bytes()
        problems.extend(host.check_host_budget(cfg, ram))
    if problems:
        raise ConfigError(problems)
    return SwapSettings.from_block(cfg, ram)


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
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
    "fp16.enabled",
    "bf16.enabled",
    "steps_per_print",
    "zero_allow_untested_optimizer",
    "checkpoint.use_node_local_storage",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
)


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


def resolve(
    ds_config: Dict[str, Any], needed_bytes: Optional[int] = None
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
        _settings_by_block.setdefault(_key(hit[0][BLOCK]), settings)
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
