"""Let unmodified programs pick up the ``"aidaptiv"`` block: ``deepspeed.initialize`` and
``deepspeed.zero.Init`` honour it once this module has run.

Installing aidaptiv-ds puts ``aidaptiv_ds_autoload.pth`` in site-packages; Python runs it at start-up and it
imports this module, which only registers an import hook (no torch, no DeepSpeed). When a program later
imports ``deepspeed``, the hook wraps two entry points:

- ``deepspeed.initialize``: a config (``config=``, ``config_params=`` or ``args.deepspeed_config``) with an
  enabled ``"aidaptiv"`` block goes through :func:`aidaptiv_ds.initialize`; any other config reaches
  DeepSpeed untouched;
- ``deepspeed.zero.Init``: such a config is validated and translated first, so that models built under
  it (Hugging Face ``from_pretrained``/``from_config`` with a ZeRO-3 config do this) are partitioned
  straight into our swap space.

So a plain ``deepspeed.initialize`` script, or HF Trainer with ``--deepspeed config.json``, started by the
``deepspeed`` launcher as usual, runs with our swapper when the config says so, and exactly as before when
it does not. Set ``AIDAPTIV_DS_AUTOLOAD=0`` to switch the hook off.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys

ENV = "AIDAPTIV_DS_AUTOLOAD"
_WRAPPED = "__aidaptiv_wrapped__"


def _config_of(args, kwargs):
    from aidaptiv_ds.zero3.initialize import load_config
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
    if getattr(original_initialize, _WRAPPED, False):
        return

    @functools.wraps(original_initialize)
    def initialize(args=None, model=None, *rest, **kwargs):
        cfg = _config_of(args, kwargs)
        if cfg is None or not is_enabled(cfg):
            return original_initialize(args, model, *rest, **kwargs)
        from aidaptiv_ds.zero3.initialize import initialize as aidaptiv_initialize
        return aidaptiv_initialize(args, model, *rest, **kwargs)

    setattr(initialize, _WRAPPED, True)
    deepspeed.initialize = initialize

    original_init = deepspeed.zero.Init

    class Init(original_init):
        __doc__ = original_init.__doc__

        def __init__(self, *args, config_dict_or_path=None, config=None, **kwargs):
            source = config_dict_or_path if config_dict_or_path is not None else config
            if source is not None:
                from aidaptiv_ds.zero3.initialize import _world_size, load_config, prepare
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

    setattr(Init, _WRAPPED, True)
    Init.__name__ = Init.__qualname__ = original_init.__name__
    Init.__module__ = original_init.__module__
    deepspeed.zero.Init = Init


def original_initialize(deepspeed):
    """``deepspeed.initialize`` as DeepSpeed defines it, even when wrapped."""
    fn = deepspeed.initialize
    return getattr(fn, "__wrapped__", fn) if getattr(fn, _WRAPPED, False) else fn


def original_zero_init(deepspeed):
    cls = deepspeed.zero.Init
    return cls.__mro__[1] if getattr(cls, _WRAPPED, False) else cls


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            patch_deepspeed(module)
        except Exception as e:  # never break `import deepspeed` because of us
            print(f"aidaptiv-ds: could not hook deepspeed ({e}); the \"aidaptiv\" block is ignored unless "
                  "aidaptiv_ds.initialize is called", file=sys.stderr)


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Waits for ``import deepspeed`` and patches the module right after it has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def install_hook() -> None:
    if os.environ.get(ENV, "1") == "0":
        return
    if "deepspeed" in sys.modules:
        try:
            patch_deepspeed(sys.modules["deepspeed"])
        except Exception:
            pass
        return
    if not any(isinstance(f, _DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedFinder())


install_hook()
