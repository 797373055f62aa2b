"""Put our engine under DeepSpeed's NVMe swappers by replacing the name ``AsyncIOBuilder`` where they look it up.

DeepSpeed's swappers build their I/O handles with ``AsyncIOBuilder().load().aio_handle(...)``. In deepspeed
0.19.8 three modules bind that name at import time (listed in :data:`compat.SWAP_MODULES_BINDING_ASYNC_IO`).
install() rebinds the name in those three to AidaptivAsyncIOBuilder, whose load() returns a module-like
object with ``aio_handle = AioHandle``; uninstall() puts DeepSpeed's back. Call install() before the DeepSpeed
engine is created (the swappers make their handles in their constructors).
"""

from __future__ import annotations

import importlib
import threading

from aidaptiv_ds.engine.aio_handle import AioHandle
from aidaptiv_ds.zero3.compat import (
    ASYNC_IO_BUILDER,
    SWAP_MODULES_BINDING_ASYNC_IO,
    check_deepspeed_version,
)

_saved: dict = {}
_lock = threading.Lock()


class _AioModule:
    """What DeepSpeed's ``AsyncIOBuilder().load()`` returns, as far as the swappers use it."""

    aio_handle = AioHandle


class AidaptivAsyncIOBuilder:
    """Stands in for deepspeed.ops.op_builder.AsyncIOBuilder: nothing to build, load() returns our handle."""

    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"

    def absolute_name(self) -> str:
        return "aidaptiv_ds.engine.aio_handle"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = False):
        return _AioModule


def install() -> None:
    """Make DeepSpeed's NVMe swappers use AioHandle. Idempotent."""
    with _lock:
        if _saved:
            return
        check_deepspeed_version()
        modules = [importlib.import_module(name) for name in SWAP_MODULES_BINDING_ASYNC_IO]
        for module in modules:
            if not hasattr(module, ASYNC_IO_BUILDER):
                raise RuntimeError(
                    f"{module.__name__} no longer binds {ASYNC_IO_BUILDER}: this DeepSpeed's swapper "
                    "layout is not supported; pin deepspeed to a supported version"
                )
        for module in modules:
            _saved[module.__name__] = getattr(module, ASYNC_IO_BUILDER)
            setattr(module, ASYNC_IO_BUILDER, AidaptivAsyncIOBuilder)


def uninstall() -> None:
    """Give DeepSpeed its own AsyncIOBuilder back. Idempotent."""
    with _lock:
        for name, original in _saved.items():
            setattr(importlib.import_module(name), ASYNC_IO_BUILDER, original)
        _saved.clear()


def installed() -> bool:
    return bool(_saved)
