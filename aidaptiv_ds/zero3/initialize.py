"""``initialize`` and ``zero_init``: DeepSpeed's entry points with the ``"aidaptiv"`` block honoured.

Both take what DeepSpeed's take (a config as a dict or a JSON/hjson path, read by
:func:`aidaptiv_ds.config.ds_config.load`). Without an enabled block they are DeepSpeed's, untouched. With one,
the config is validated (every problem reported at once, before any file is opened) and resolved, once
per config even when both are called with it, rewritten so ZeRO-3 takes its NVMe paths, our swappers are
installed, the model's mixture-of-experts blocks become ZeRO-3 leaf modules (:mod:`aidaptiv_ds.zero3.moe`), and
the engine returned by ``initialize`` gains ``aidaptiv_stats()`` and checkpoints that carry every byte of the
swapped state.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Dict, Optional, Tuple

from aidaptiv_ds.common.sizes import dtype_bytes, swap_bytes_per_param
from aidaptiv_ds.config import host, schema
from aidaptiv_ds.config import resolve as config_resolve
from aidaptiv_ds.config import settings as config_settings
from aidaptiv_ds.config.ds_config import dtype_name
from aidaptiv_ds.config.ds_config import load as load_config

log = logging.getLogger(__name__)


def _model_numel(model, trainable: bool) -> int:
    """Elements of the model's trainable (or frozen) parameters, partitioned ones counted whole."""
    if model is None:
        return 0
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad == trainable)


def _swap_bytes_written(ds_config: Dict[str, Any]) -> int:
    """Disk bytes the swap folders under the block's ``nvme_path`` already take (``<nvme_path>/aidaptiv-swap``:
    every rank of this node that shares the disk). ``zero.Init`` writes the parameters there before
    ``initialize`` knows the model; those bytes are part of the need, already taken from the free space."""
    block = schema.block_of(ds_config) or {}
    path = block.get("nvme_path") if isinstance(block, dict) else None
    if not path:
        return 0
    total = 0
    for folder, _, files in os.walk(os.path.join(os.path.abspath(path), "aidaptiv-swap")):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:  # a file another rank removes meanwhile
                continue
    return total


def needed_swap_bytes(
    model, ds_config: Dict[str, Any], world_size: int, local_ranks: Optional[int] = None
) -> Optional[int]:
    """NVMe bytes the model state of this node's ranks still needs (None when the model is unknown): every rank
    on the node (``local_ranks``, from the launcher's environment when None) swaps to the same filesystem, so
    the free space must hold all their shares, less what their swap folders already take."""
    trained, frozen = _model_numel(model, trainable=True), _model_numel(model, trainable=False)
    if not trained + frozen:
        return None
    local = max(1, min(local_ranks or host.local_rank_count(), max(1, world_size)))
    param_bytes = dtype_bytes(dtype_name(ds_config))
    world = max(1, world_size)
    # A frozen parameter (a LoRA base) is only its own bytes on the disk: no gradient, master copy or moments.
    per_rank = swap_bytes_per_param(param_bytes) * -(-trained // world) + param_bytes * -(-frozen // world)
    return max(0, per_rank * local - _swap_bytes_written(ds_config))


def prepare(
    ds_config: Dict[str, Any], model=None, world_size: int = 1
) -> Tuple[Dict[str, Any], Optional[config_settings.SwapSettings]]:
    """Validate, resolve and translate (once per config: see :func:`aidaptiv_ds.config.resolve.resolve`) and install
    our swappers; returns (config for DeepSpeed, resolved settings or None)."""
    translated, settings = config_resolve.resolve(
        ds_config, needed_bytes=needed_swap_bytes(model, ds_config, world_size)
    )
    if settings is None:
        return ds_config, None
    from aidaptiv_ds.zero3.install import install

    install()
    return translated, settings


def _return_freed_heap() -> None:
    """Give the C heap's free memory back to the OS. Building the model and DeepSpeed's set-up allocate and
    free hundreds of MB in pieces below glibc's mmap threshold; freed, they stay in the process (and count
    against a cgroup's memory limit) until trimmed. Best effort: nothing happens without glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _world_size() -> int:
    try:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            return tdist.get_world_size()
    except Exception:
        pass
    return int(os.environ.get("WORLD_SIZE", "1"))


def zero_init(config, **kwargs):
    """``deepspeed.zero.Init`` for a config that may carry an ``"aidaptiv"`` block: build the model inside
    it so that its partitions go straight to our swap space instead of being materialised in RAM."""
    import deepspeed

    from aidaptiv_ds.zero3.originals import original_zero_init

    ds_config = load_config(config)
    translated, _ = prepare(ds_config, None, _world_size())
    return original_zero_init(deepspeed)(config_dict_or_path=translated, **kwargs)


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    config=None,
    config_params=None,
    **kwargs,
):
    """Same signature and returns as ``deepspeed.initialize``."""
    import deepspeed

    from aidaptiv_ds.zero3.originals import original_initialize

    source = config if config is not None else config_params
    if source is None and args is not None and getattr(args, "deepspeed_config", None):
        source = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None  # DeepSpeed refuses a config given both ways
    ds_config = load_config(source)
    translated, settings = (ds_config, None) if ds_config is None else prepare(ds_config, model, _world_size())
    if settings is not None and model is not None:
        from aidaptiv_ds.zero3.moe import mark_moe_blocks

        mark_moe_blocks(model)  # before DeepSpeed installs its hooks (see zero3/moe.py)
    engine, opt, loader, sched = original_initialize(deepspeed)(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        config=translated,
        **kwargs,
    )
    from aidaptiv_ds.zero3 import (
        dist_shm,  # DeepSpeed's CPU communicator would leak its /dev/shm segments
    )

    dist_shm.release_after_barrier()
    if settings is not None:
        runtime = getattr(engine.optimizer, "_aidaptiv", None)
        if runtime is None:
            raise RuntimeError(
                "aidaptiv is enabled but DeepSpeed did not build the aidaptiv ZeRO-3 optimizer: "
                "is zero_optimization.stage 3 and an optimizer configured?"
            )
        from aidaptiv_ds.zero3.engine_hooks import attach

        attach(engine, runtime)
        problem = engine.aidaptiv_save_problem()
        if problem:
            log.warning("aidaptiv: %s", problem)
        from aidaptiv_ds.zero3.activations import apply_to_engine

        apply_to_engine(engine, runtime, settings)
        _return_freed_heap()
    return engine, opt, loader, sched
