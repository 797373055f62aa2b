"""aidaptiv-ds: fine-tune language models larger than GPU memory by streaming model state through NVMe.

Add an ``"aidaptiv"`` block to a DeepSpeed ZeRO-3 config and use :func:`initialize` (same signature and
returns as ``deepspeed.initialize``) and, to build large models directly into the swap space,
:func:`zero_init` (a ``deepspeed.zero.Init`` for that config). The C++ engine (``aidaptiv_ds.engine._C``) moves
bytes between pinned host memory and files with io_uring; ``aidaptiv_ds.engine.io`` is its Python face.
Everything that touches DeepSpeed internals lives in ``aidaptiv_ds.zero3``. :func:`remove_leaked_shared_memory`
is for tools that run many DeepSpeed jobs on CPU one after another (the sweep, the tests).
"""

from __future__ import annotations

from typing import Optional

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` that honours the config's ``"aidaptiv"`` block (see aidaptiv_ds.zero3)."""
    from aidaptiv_ds.zero3.initialize import initialize as _initialize

    return _initialize(*args, **kwargs)


def zero_init(config, **kwargs):
    """``deepspeed.zero.Init(config_dict_or_path=config, **kwargs)`` that honours the ``"aidaptiv"`` block."""
    from aidaptiv_ds.zero3.initialize import zero_init as _zero_init

    return _zero_init(config, **kwargs)


def remove_leaked_shared_memory(min_age_s: float = 600) -> Optional[str]:
    """Remove this user's /dev/shm segments that DeepSpeed's CPU communicator left behind in earlier runs
    (older than ``min_age_s`` and mapped by no live process); returns one line saying what was freed, or None
    if there was nothing to remove."""
    from aidaptiv_ds.zero3 import dist_shm

    removed, freed = dist_shm.remove_stale_segments(min_age_s)
    return dist_shm.describe_removed(removed, freed) if removed else None
