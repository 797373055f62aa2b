"""DeepSpeed's two entry points, wrapped so that they honour the ``"aidaptiv"`` block.

:func:`patch_deepspeed` replaces, on the ``deepspeed`` module itself:

- ``deepspeed.initialize``: a config (``config=``, ``config_params=`` or ``args.deepspeed_config``) with an
  enabled ``"aidaptiv"`` block goes through :func:`aidaptiv_ds.zero3.initialize.initialize`; any other
  config reaches DeepSpeed untouched;
- ``deepspeed.zero.Init``: a subclass that validates and translates such a config first, so that models
  built under it (Hugging Face ``from_pretrained``/``from_config`` with a ZeRO-3 config do this) are
  partitioned straight into our swap space.

It also mends one DeepSpeed 0.19 bug that makes ZeRO-3 train in a dtype the config did not ask for, for
every config (ours and the baselines alike): see :func:`honour_explicit_dtype`; and it answers DeepSpeed's
repeated questions about the CPU once per process (:func:`remember_cpu_info`), seconds of every start-up.

:mod:`aidaptiv_ds.autoload` calls it right after ``import deepspeed``. DeepSpeed's own functions stay
reachable through :mod:`aidaptiv_ds.zero3.originals`, which is what our initialize calls.
"""

from __future__ import annotations

import copy
import functools
import logging

from aidaptiv_ds.zero3 import compat
from aidaptiv_ds.zero3.originals import WRAPPED, is_wrapped, original_zero_init


def _config_of(args, kwargs):
    from aidaptiv_ds.config.ds_config import load as load_config

    source = kwargs.get("config") if kwargs.get("config") is not None else kwargs.get("config_params")
    if source is None and args is not None and getattr(args, "deepspeed_config", None):
        source = args.deepspeed_config
    try:
        return load_config(source)
    except (OSError, ValueError):
        return None  # DeepSpeed reports unreadable configs itself


def honour_explicit_dtype(deepspeed) -> None:
    """Make ``zero.Init(dtype=...)`` partition in that dtype (idempotent).

    DeepSpeed 0.19.8 chooses ``dtype or torch.float16 if accelerator.is_fp16_supported() else torch.bfloat16
    ...``: by operator precedence an explicit dtype is dropped whenever the accelerator reports no fp16, which
    DeepSpeed's CPU accelerator does on CPUs whose oneDNN lacks fp16 (AMD EPYC among them). The engine
    partitions a model that was not built under ``zero.Init`` with ``Init(module=..., dtype=<training
    dtype>)``, so an fp32 run got bf16 partitions and failed in its first forward ("expected m1 and m2 to
    have the same dtype"). An explicit dtype now wins; without one DeepSpeed decides as before.
    """
    init_cls = original_zero_init(deepspeed)
    original = getattr(init_cls, compat.ZERO_INIT_SET_DTYPE, None)
    if original is None:
        raise compat.UnsupportedDeepSpeedError(
            f"deepspeed.zero.Init has no {compat.ZERO_INIT_SET_DTYPE} where DeepSpeed 0.19 keeps it: this DeepSpeed "
            "is not supported"
        )
    if is_wrapped(original):
        return

    @functools.wraps(original)
    def set_dtype(self, ds_config, dtype):
        if dtype is not None:
            self.dtype = dtype
            return
        original(self, ds_config, dtype)

    setattr(set_dtype, WRAPPED, True)
    setattr(init_cls, compat.ZERO_INIT_SET_DTYPE, set_dtype)


def remember_cpu_info() -> None:
    """Make ``cpuinfo.get_cpu_info()`` ask once per process (idempotent; a no-op without py-cpuinfo).

    DeepSpeed 0.19.8 calls it five times in a process that builds CPU Adam and async_io (CPU Adam's
    constructor, and each CPU op builder's ``cpu_arch`` and ``simd_width`` while it loads the op), and every
    call starts a Python process that times the CPU: about 1.2 s each, 6 s of a rank's start-up on a small
    machine. The CPU does not change while a process runs, so the first answer is kept; each caller gets a copy
    of it (a caller that edits its dict cannot change what the next one reads)."""
    try:
        import cpuinfo
    except ImportError:
        return
    original = cpuinfo.get_cpu_info
    if is_wrapped(original):
        return
    answer = []

    @functools.wraps(original)
    def get_cpu_info():
        if not answer:
            answer.append(original())
        return copy.deepcopy(answer[0])

    setattr(get_cpu_info, WRAPPED, True)
    cpuinfo.get_cpu_info = get_cpu_info


def patch_deepspeed(deepspeed) -> None:
    """Wrap ``deepspeed.initialize`` and ``deepspeed.zero.Init``, mend Init's dtype choice and ask the CPU's
    features once (idempotent)."""
    from aidaptiv_ds.config.ds_config import lookalike_blocks
    from aidaptiv_ds.config.schema import is_enabled

    remember_cpu_info()
    honour_explicit_dtype(deepspeed)

    original_initialize = deepspeed.initialize
    if is_wrapped(original_initialize):
        return

    @functools.wraps(original_initialize)
    def initialize(args=None, model=None, *rest, **kwargs):
        cfg = _config_of(args, kwargs)
        if cfg is None or not is_enabled(cfg):
            for problem in lookalike_blocks(cfg):  # a misspelt block would train without aidaptiv: say so
                logging.getLogger("aidaptiv_ds").warning("aidaptiv: %s", problem)
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
                from aidaptiv_ds.config.ds_config import load as load_config
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
