"""Put our engine under DeepSpeed's NVMe swappers by replacing the name ``AsyncIOBuilder`` where they look it up.

DeepSpeed's swappers build their I/O handles with ``AsyncIOBuilder().load().aio_handle(...)``. In deepspeed
0.19.8 three modules bind that name at import time (``from deepspeed.ops.op_builder import AsyncIOBuilder``):
swap_tensor.partitioned_param_swapper, swap_tensor.partitioned_optimizer_swapper and
swap_tensor.pipelined_optimizer_swapper (optimizer_utils and utils only receive handles). install() rebinds
the name in those three to AidaptivAsyncIOBuilder, whose load() returns a module-like object with
``aio_handle = AioHandle``; uninstall() puts DeepSpeed's back. Call install() before the DeepSpeed engine
is created (the swappers make their handles in their constructors).
"""
from __future__ import annotations

import importlib
import threading

from aidaptiv_ds.aio_handle import AioHandle

SUPPORTED_DEEPSPEED = ((0, 19), (0, 20))  # [low, high): the private names below are checked for these
SWAP_MODULES = (
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
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
        return "aidaptiv_ds.aio_handle"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = False):
        return _AioModule


def _check_version() -> None:
    import deepspeed

    parts = tuple(int(p) for p in deepspeed.__version__.split("+")[0].split(".")[:2])
    low, high = SUPPORTED_DEEPSPEED
    if not (low <= parts < high):
        raise RuntimeError(
            f"aidaptiv_ds replaces AsyncIOBuilder in DeepSpeed's swap modules, checked for deepspeed "
            f"{low[0]}.{low[1]}.x; this is deepspeed {deepspeed.__version__}: install deepspeed=={low[0]}.{low[1]}.*"
        )


def install() -> None:
    """Make DeepSpeed's NVMe swappers use AioHandle. Idempotent."""
    with _lock:
        if _saved:
            return
        _check_version()
        modules = [importlib.import_module(name) for name in SWAP_MODULES]
        for module in modules:
            if not hasattr(module, "AsyncIOBuilder"):
                raise RuntimeError(f"{module.__name__} no longer binds AsyncIOBuilder: this DeepSpeed's swapper "
                                   "layout is not supported; pin deepspeed to a supported version")
        for module in modules:
            _saved[module.__name__] = module.AsyncIOBuilder
            module.AsyncIOBuilder = AidaptivAsyncIOBuilder


def uninstall() -> None:
    """Give DeepSpeed its own AsyncIOBuilder back. Idempotent."""
    with _lock:
        for name, original in _saved.items():
            setattr(importlib.import_module(name), "AsyncIOBuilder", original)
        _saved.clear()


def installed() -> bool:
    return bool(_saved)


def deepspeed_aio_handle():
    """DeepSpeed's own libaio aio_handle class (the baseline of io-bench), whatever install() did; builds
    the async_io op just in time if it is not cached (TORCH_EXTENSIONS_DIR). Raises what the build raises."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load(verbose=False).aio_handle
