"""DeepSpeed's own ``initialize`` and ``zero.Init``, whether or not :mod:`aidaptiv_ds.zero3.entry_points` has
wrapped them, and the mark its wrappers carry.

This sits below both the wrappers and :mod:`aidaptiv_ds.zero3.initialize`: the wrappers call our initialize,
which calls DeepSpeed's originals from here, so no import leads back to the wrappers.
"""

from __future__ import annotations

WRAPPED = "__aidaptiv_wrapped__"  # set to True on our wrapper function and our Init subclass


def is_wrapped(obj) -> bool:
    return bool(getattr(obj, WRAPPED, False))


def original_initialize(deepspeed):
    """``deepspeed.initialize`` as DeepSpeed defines it, even when wrapped."""
    fn = deepspeed.initialize
    return getattr(fn, "__wrapped__", fn) if is_wrapped(fn) else fn


def original_zero_init(deepspeed):
    """``deepspeed.zero.Init`` as DeepSpeed defines it, even when wrapped (our Init subclasses it directly)."""
    cls = deepspeed.zero.Init
    return cls.__mro__[1] if is_wrapped(cls) else cls
