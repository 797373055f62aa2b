"""The Python face of the I/O engine: pinned buffers, swap files, asynchronous reads and writes.

    from aidaptiv_ds.engine.io import IOEngine, PinnedPool

    pool = PinnedPool(256 << 20)                       # one page-locked allocation, 256 MiB budget
    with IOEngine(pool=pool) as engine:                # io_uring if it starts, else a POSIX thread pool
        f = engine.open("/nvme/swap/layer0.bin", create=True)
        buf = pool.allocate(1 << 20, torch.float16)
        engine.write(buf, f)                           # blocking
        req = engine.read_async(buf, f, offset=0)      # returns at once
        req.wait()                                     # bytes read, or raises the first error

All I/O is O_DIRECT (the page cache is bypassed, so reads measure the disk and swapped state does not
also fill host RAM). Buffers and file offsets must be 4 KiB aligned (allocate from a PinnedPool);
lengths may be anything. Failed system calls raise OSError with errno and filename (FileNotFoundError,
PermissionError, ...); bad arguments raise ValueError.

Settings come from defaults, then environment variables, then arguments (the later wins):
AIDAPTIV_BACKEND (auto | io_uring | posix), AIDAPTIV_BLOCK_SIZE (bytes, or a size such as 1M or 256KiB, read by
:func:`aidaptiv_ds.common.sizes.parse_size`),
AIDAPTIV_QUEUE_DEPTH.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from typing import Optional, Union

import torch

from aidaptiv_ds.common.sizes import ALIGN, align_up, parse_size
from aidaptiv_ds.engine import _C
from aidaptiv_ds.engine.backend import Backend

logger = logging.getLogger(__name__)

# The engine is compiled with its own copy of the O_DIRECT alignment; a build that disagrees with
# sizes.ALIGN would accept buffers the Python layers never align for.
if int(_C.ALIGNMENT) != ALIGN:
    raise ImportError(
        f"aidaptiv_ds.engine._C was built with O_DIRECT alignment {int(_C.ALIGNMENT)} but the package "
        f"aligns to {ALIGN}: rebuild the extension (pip install -e .)"
    )
# The C++ string ABI must be torch's: the engine hands std::string and torch's c10::Error across that boundary.
if hasattr(_C, "GLIBCXX_USE_CXX11_ABI") and bool(_C.GLIBCXX_USE_CXX11_ABI) != bool(torch._C._GLIBCXX_USE_CXX11_ABI):
    raise ImportError(
        f"aidaptiv_ds.engine._C was built with _GLIBCXX_USE_CXX11_ABI={int(_C.GLIBCXX_USE_CXX11_ABI)} ({_C.COMPILER}) "
        f"but this torch {torch.__version__} uses {int(torch._C._GLIBCXX_USE_CXX11_ABI)}: rebuild the engine "
        "against this torch (pip install --no-build-isolation -e .)"
    )
DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_THREADS = 4

_logged: set = set()
_logged_lock = threading.Lock()


def _log_once(message: str) -> None:
    """Log a setup message (fallback, unlocked pool, ...) once per process, not once per engine."""
    with _logged_lock:
        if message in _logged:
            return
        _logged.add(message)
    logger.warning(message)


_TO_C = {
    Backend.IO_URING: _C.BackendKind.IO_URING,
    Backend.POSIX: _C.BackendKind.POSIX,
    Backend.AUTO: _C.BackendKind.AUTO,
}
_FROM_NAME = {"io_uring": Backend.IO_URING, "posix": Backend.POSIX}


def resolve_settings(backend=None, block_size=None, queue_depth=None) -> dict:
    """Defaults, then AIDAPTIV_* environment variables, then arguments (None means 'not given')."""
    settings = {"backend": Backend.AUTO, "block_size": DEFAULT_BLOCK_SIZE, "queue_depth": DEFAULT_QUEUE_DEPTH}
    env = os.environ
    if env.get("AIDAPTIV_BACKEND"):
        settings["backend"] = Backend.parse(env["AIDAPTIV_BACKEND"], "AIDAPTIV_BACKEND")
    if env.get("AIDAPTIV_BLOCK_SIZE"):
        settings["block_size"] = parse_size(env["AIDAPTIV_BLOCK_SIZE"], "AIDAPTIV_BLOCK_SIZE")
    if env.get("AIDAPTIV_QUEUE_DEPTH"):
        try:
            settings["queue_depth"] = int(env["AIDAPTIV_QUEUE_DEPTH"])
        except ValueError:
            raise ValueError(
                f"AIDAPTIV_QUEUE_DEPTH={env['AIDAPTIV_QUEUE_DEPTH']!r} is not an integer: expected e.g. 32"
            ) from None
    if backend is not None:
        settings["backend"] = Backend.parse(backend)
    if block_size is not None:
        settings["block_size"] = int(block_size)
    if queue_depth is not None:
        settings["queue_depth"] = int(queue_depth)
    return settings


class PinnedPool:
    """One page-locked host allocation with a hard byte budget, handing out 4 KiB-aligned tensors.

    Why: O_DIRECT needs aligned buffers; page-locked memory makes host<->GPU copies true DMA; io_uring
    registers the whole pool once as fixed buffers, saving page pinning on every I/O. The pool starts on a 2 MiB
    boundary and asks for transparent huge pages, so a 1 MiB piece of I/O is one physically contiguous DMA
    segment (in scattered 4 KiB pages the test machine's virtio disk split every piece in two, and reading a
    3.9 GB file in 176 MiB requests through two reused buffers ran at 1.28 GB/s instead of 2.45). Tensors return their
    block to the pool when freed (the pool lives as long as any of them). Locking is best effort: when the
    locked-memory limit (ulimit -l) is too small the pool still works, and says so once.
    """

    def __init__(self, capacity_bytes: int):
        self._pool = _C.PinnedPool(int(capacity_bytes))
        note = self._pool.stats().lock_note
        if note:
            _log_once(note)

    def allocate(self, numel: int, dtype: torch.dtype = torch.uint8, from_top: bool = False) -> torch.Tensor:
        """A 1-D tensor of numel elements, 4 KiB aligned; MemoryError when the budget is exhausted.
        ``from_top`` places it at the high end of the pool: keep long-lived large buffers at the low end
        and the rest at the high end so that the rest cannot cut up the space large buffers need."""
        return self._pool.allocate(int(numel), dtype, bool(from_top))

    def try_allocate(
        self, numel: int, dtype: torch.dtype = torch.uint8, from_top: bool = False
    ) -> Optional[torch.Tensor]:
        """allocate(), or None when no free block fits: for callers to whom a full pool is routine (they
        reclaim and ask again). Nothing is raised on that path, in C++ either."""
        return self._pool.try_allocate(int(numel), dtype, bool(from_top))

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether the tensor's bytes lie inside this pool (so they may be registered buffers)."""
        if tensor.device.type != "cpu":
            return False
        return self._pool.contains(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def stats(self) -> dict:
        """capacity, in_use, high_water, largest_free (bytes), blocks, locked, lock_method, lock_note."""
        s = self._pool.stats()
        return {
            k: getattr(s, k)
            for k in (
                "capacity",
                "in_use",
                "high_water",
                "largest_free",
                "blocks",
                "locked",
                "lock_method",
                "lock_note",
            )
        }

    @property
    def capacity(self) -> int:
        return self._pool.capacity


class SwapFile:
    """A file opened by an IOEngine (O_DIRECT, O_NOFOLLOW, 0600 when created). Pass it to read/write."""

    def __init__(self, engine: "IOEngine", file_id: int, path: str):
        self._engine, self.id, self.path = engine, file_id, path
        self.closed = False

    def close(self) -> None:
        self._engine.close(self)

    def __repr__(self) -> str:
        return f"SwapFile({self.path!r}{', closed' if self.closed else ''})"


class IORequest:
    """One submitted read or write. It keeps its tensor referenced until completion is observed, so the
    buffer cannot be freed under I/O; the engine keeps the request until then for the same reason."""

    def __init__(self, engine: "IOEngine", handle: int, tensor: torch.Tensor, op: str):
        self._engine, self._handle, self._tensor, self.op = engine, handle, tensor, op
        self._lock = threading.Lock()
        self._finished = False
        self._result: Optional[int] = None
        self._error: Optional[Exception] = None

    def wait(self) -> int:
        """Block (without the GIL) until this request alone completes; return its bytes or raise its error."""
        with self._lock:
            if not self._finished:
                try:
                    self._result = self._engine._engine.wait(self._handle)
                except Exception as e:  # kept without its traceback, raised as a copy on every wait()
                    self._error = e.with_traceback(None)
                self._finished = True
                self._tensor = None
                self._engine._forget(self._handle)
        if self._error is not None:
            # A copy: raising the kept exception itself would tie it, through its traceback, to this
            # request and to the caller's frames (and their buffers) until the garbage collector runs.
            raise copy.copy(self._error)
        return self._result

    def done(self) -> bool:
        """Whether the request has completed; never blocks (its error, if any, is raised by wait())."""
        if self._finished:
            return True
        # Under the request's lock: another thread may be finishing wait() right now, after which the engine
        # no longer knows the handle. Never blocks: a thread inside wait() holds the lock, and then the
        # request is simply not known to be done yet.
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._finished:
                return True
            if not self._engine._engine.poll(self._handle):
                return False
        finally:
            self._lock.release()
        try:
            self.wait()
        except Exception:
            pass
        return True

    def __repr__(self) -> str:
        state = "done" if self._finished else "in flight"
        return f"IORequest({self.op}, handle={self._handle}, {state})"


FileLike = Union[SwapFile, str, "os.PathLike[str]"]


class IOEngine:
    """Asynchronous O_DIRECT reads and writes between host tensors and files.

    backend: "auto" (default; io_uring, else the POSIX thread pool, with the reason in fallback_reason),
        "io_uring" (an error if it cannot start) or "posix".
    block_size: bytes per piece a request is cut into (default 1 MiB, a multiple of 4096).
    queue_depth: pieces in flight at most (default 32).
    threads: POSIX backend worker threads (default 4).
    pool: a PinnedPool whose memory io_uring registers as fixed buffers (optional).
    sqpoll: io_uring kernel submission thread; costs a whole core, off by default.
    backend, block_size and queue_depth default to AIDAPTIV_BACKEND, AIDAPTIV_BLOCK_SIZE and
    AIDAPTIV_QUEUE_DEPTH when those are set and the argument is not given.
    """

    def __init__(
        self,
        backend: Union[str, Backend, None] = None,
        block_size: Optional[int] = None,
        queue_depth: Optional[int] = None,
        threads: int = DEFAULT_THREADS,
        pool: Optional[PinnedPool] = None,
        sqpoll: bool = False,
    ):
        settings = resolve_settings(backend, block_size, queue_depth)
        options = _C.EngineOptions()
        options.backend = _TO_C[settings["backend"]]
        options.block_size = settings["block_size"]
        options.queue_depth = settings["queue_depth"]
        options.threads = int(threads)
        options.sqpoll = bool(sqpoll)
        self.pool = pool
        self.requested_backend = settings["backend"]
        self._engine = _C.Engine(options, pool._pool if pool is not None else None)
        self._outstanding: dict = {}
        self._files: dict = {}
        self._lock = threading.Lock()
        self.closed = False
        self._direct_fallbacks_logged = False
        for note in (self._engine.fallback_reason, self._engine.fixed_buffers_note, self._engine.setup_note):
            if note:
                _log_once(note)

    # -- settings and state -------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The backend actually running (never AUTO)."""
        return _FROM_NAME[self._engine.backend_name]

    @property
    def fallback_reason(self) -> Optional[str]:
        """Why 'auto' runs POSIX instead of io_uring; None when it did not fall back."""
        return self._engine.fallback_reason or None

    @property
    def fixed_buffers(self) -> bool:
        """Whether the pool is registered with io_uring as fixed buffers."""
        return self._engine.fixed_buffers

    # -- files --------------------------------------------------------------------------------------
    def open(self, path, create: bool = False, exclusive: bool = False) -> SwapFile:
        """Open (or with create, make: mode 0600) a swap file; refuses symlinks and other users' files."""
        path = os.fspath(path)
        file_id = self._engine.open(path, create, exclusive)
        f = SwapFile(self, file_id, path)
        with self._lock:
            self._files[file_id] = f
        return f

    def close(self, f: Optional[SwapFile] = None) -> None:
        """close(f) closes a file (I/O in flight on it still completes); close() closes the engine."""
        if f is None:
            self.shutdown()
            return
        if f.closed:
            return
        self._engine.close(f.id)
        f.closed = True
        with self._lock:
            self._files.pop(f.id, None)

    def _file_arg(self, f: FileLike):
        if isinstance(f, SwapFile):
            if f._engine is not self:
                raise ValueError(f"{f!r} was opened by another IOEngine: open it with this one")
            if f.closed:
                raise ValueError(f"{f!r} is closed: open it again")
            return f.id
        return os.fspath(f)

    # -- I/O ----------------------------------------------------------------------------------------
    def read_async(self, tensor: torch.Tensor, file: FileLike, offset: int = 0) -> IORequest:
        """Start reading tensor.nbytes bytes at offset of file into tensor; returns at once."""
        handle = self._engine.read_async(tensor, self._file_arg(file), int(offset))
        return self._track(handle, tensor, "read")

    def write_async(self, tensor: torch.Tensor, file: FileLike, offset: int = 0) -> IORequest:
        """Start writing tensor's bytes at offset of file (a path is created, 0600, if missing)."""
        handle = self._engine.write_async(tensor, self._file_arg(file), int(offset))
        return self._track(handle, tensor, "write")

    def read(self, tensor: torch.Tensor, file: FileLike, offset: int = 0) -> int:
        """Blocking read_async(...).wait(): bytes read."""
        return self.read_async(tensor, file, offset).wait()

    def write(self, tensor: torch.Tensor, file: FileLike, offset: int = 0) -> int:
        """Blocking write_async(...).wait(): bytes written."""
        return self.write_async(tensor, file, offset).wait()

    def wait_all(self) -> None:
        """Wait for every request in flight; raise the first error among them once all have drained."""
        with self._lock:
            pending = sorted(self._outstanding.items())
        first: Optional[BaseException] = None
        for _, request in pending:
            try:
                request.wait()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def _track(self, handle: int, tensor: torch.Tensor, op: str) -> IORequest:
        request = IORequest(self, handle, tensor, op)
        with self._lock:
            self._outstanding[handle] = request
        return request

    def _forget(self, handle: int) -> None:
        with self._lock:
            self._outstanding.pop(handle, None)

    # -- GPU ----------------------------------------------------------------------------------------
    def read_to_device(
        self, tensor: torch.Tensor, file: FileLike, offset: int = 0, staging: Optional[torch.Tensor] = None
    ) -> int:
        """File -> pinned staging -> GPU tensor, reading chunk i+1 while chunk i is copied (blocking)."""
        return self._device_copy("read_to_device", tensor, file, offset, staging)

    def write_from_device(
        self, tensor: torch.Tensor, file: FileLike, offset: int = 0, staging: Optional[torch.Tensor] = None
    ) -> int:
        """GPU tensor -> pinned staging -> file, copying chunk i+1 while chunk i is written (blocking)."""
        return self._device_copy("write_from_device", tensor, file, offset, staging)

    def _device_copy(self, name, tensor, file, offset, staging) -> int:
        if not _C.WITH_CUDA:
            raise RuntimeError(
                f"{name} needs aidaptiv_ds built with CUDA (this build has none): install "
                "it with a CUDA torch, or copy through a host tensor"
            )
        if staging is None:
            if self.pool is None:
                raise ValueError(f"{name} needs a staging tensor or an IOEngine created with a pool")
            nbytes = tensor.numel() * tensor.element_size()
            half = min(8 << 20, max(ALIGN, align_up(nbytes)))
            staging = self.pool.allocate(2 * half, torch.uint8)
        return getattr(self._engine, name)(tensor, self._file_arg(file), int(offset), staging)

    # -- lifetime and stats -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters since creation: bytes/requests read and written, errors, in_flight, wait_seconds, and
        direct_fallbacks (O_DIRECT pieces the kernel refused with EINVAL, retried through the page cache)."""
        s = self._engine.stats()
        out = {"backend": self.backend.value, "fixed_buffers": self.fixed_buffers}
        out.update(
            {
                k: getattr(s, k)
                for k in (
                    "bytes_read",
                    "bytes_written",
                    "reads",
                    "writes",
                    "errors",
                    "in_flight",
                    "wait_seconds",
                    "direct_fallbacks",
                )
            }
        )
        self._log_direct_fallbacks(s.direct_fallbacks)
        if self.pool is not None:
            out["pool"] = self.pool.stats()
        return out

    def _log_direct_fallbacks(self, count: int) -> None:
        """Warn once per engine (from stats() or shutdown()) that O_DIRECT fell back to the page cache."""
        if count and not self._direct_fallbacks_logged:
            self._direct_fallbacks_logged = True
            logger.warning(
                "%d O_DIRECT transfer(s) were refused with EINVAL and retried through the page cache "
                "(slower, and they use page-cache memory): a file-size limit (ulimit -f) or the "
                "filesystem cut them at an unaligned byte; put nvme_path on a filesystem that "
                "supports O_DIRECT (ext4, xfs) and check ulimit -f",
                count,
            )

    def shutdown(self) -> None:
        """Wait for all I/O, close all files and stop the engine's threads. Errors of requests nobody
        waited for are dropped here (wait_all() first to see them)."""
        if self.closed:
            return
        try:
            self.wait_all()
        except Exception as e:
            logger.warning("I/O error at engine shutdown (no one waited for it): %s", e)
        finally:
            self._engine.shutdown()
            self._log_direct_fallbacks(self._engine.stats().direct_fallbacks)
            with self._lock:
                for f in self._files.values():
                    f.closed = True
                self._files.clear()
            self.closed = True

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Wait for everything and close the files. A failed request raises here, unless an exception is
        # already on its way out (which it must not hide).
        try:
            if exc_type is None:
                self.wait_all()
        finally:
            self.shutdown()

    def __repr__(self) -> str:
        return f"IOEngine(backend={self.backend.value}, closed={self.closed})"
