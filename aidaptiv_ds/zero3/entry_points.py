"""DeepSpeed's two entry points, wrapped so that they honour the ``"aidaptiv"`` block.

:func:`patch_deepspeed` replaces, on the ``deepspeed`` module itself:

- ``deepspeed.initialize``: a config (``config=``, ``config_params=`` or ``args.deepspeed_config``) with an
  enabled ``"aidaptiv"`` block goes through :func:`aidaptiv_ds.zero3.initialize.initialize`; any other
  config reaches DeepSpeed untouched;
- ``deepspeed.zero.Init``: a subclass that validates and translates such a config first, so that models
  built under it (Hugging Face ``from_pretrained``/``from_config`` with a ZeRO-3 config do this) are
  partitioned straight into our swap space.

:mod:`aidaptiv_ds.autoload` calls it right after ``import deepspeed``. DeepSpeed's own functions stay
reachable through :mod:`aidaptiv_ds.zero3.originals`, which is what our initialize calls.
"""
from __future__ import annotations

import functools

from aidaptiv_ds.zero3.originals import WRAPPED, is_wrapped


def _config_of(args, kwargs):
    from aidaptiv_ds.ds_config import load as load_config
    source = kwargs.get("config") if kwargs.get("config") is not None else kwargs.get("config_params")
    if source is None and args is not None and getattr(args, "deepspeed_config", None):
        source = args.deepspeed_config
    try:
        return load_config(source)
    except (OSError, ValueError):
        return None  # DeepSpeed reports unreadable configs itself


def patch_deepspeed(deepspeed) -> None:
    """Wrap ``deepspeed.initialize`` and ``deepspeed.zero.Init`` (idempotent)."""
    from aidaptiv_ds.config import is_enabled

    original_initialize = deepspeed.initialize
    if is_wrapped(original_initialize):
        return

    @functools.wraps(original_initialize)
    def initialize(args=None, model=None, *rest, **kwargs):
        cfg = _config_of(args, kwargs)
        if cfg is None or not is_enabled(cfg):
            return original_initialize(args, model, *rest, **kwargs)
        from aidaptiv_ds.zero3.initialize import initialize as aidaptiv_initialize
        return aidaptiv_initialize(args, model, *rest, **kwargs)

    setattr(initialize, WRAPPED, True)
    deepspeed.initialize = initialize

    original_init = deepspeed.zero.Init

    class Init(original_init):
        __doc__ = original_init.__doc__

        def __init__(self, *args, config_dict_or_path=None, config=None, **kwargs):
            source = config_dict_or_path if config_dict_or_path is not None else config
            if source is not None:
                from aidaptiv_ds.ds_config import load as load_config
                from aidaptiv_ds.zero3.initialize import _world_size, prepare
                try:
                    cfg = load_config(source)
                except (OSError, ValueError):
                    cfg = None
                if cfg is not None and is_enabled(cfg):
                    source, _ = prepare(cfg, None, _world_size())
            if config is not None and config_dict_or_path is None:
                kwargs["config"] = source
            else:
                kwargs["config_dict_or_path"] = source
            super().__init__(*args, **kwargs)

    setattr(Init, WRAPPED, True)
    Init.__name__ = Init.__qualname__ = original_init.__name__
    Init.__module__ = original_init.__module__
    deepspeed.zero.Init = Init

