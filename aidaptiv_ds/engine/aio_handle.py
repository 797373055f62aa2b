"""DeepSpeed's ``aio_handle`` interface on top of our engine, so ZeRO-Infinity's swappers can use it as is.

Same constructor, methods, arguments and return values as ``deepspeed.ops.op_builder.AsyncIOBuilder().load()
.aio_handle`` (deepspeed 0.19.8, ops/csrc/aio/py_lib/py_ds_aio.cpp and deepspeed_py_io_handle.cpp):
async_pread/async_pwrite queue an op and return 0; wait() waits for every queued op and returns how many
completed; sync_pread/sync_pwrite queue one op, then wait() (so they return the count of all ops waited
for, as DeepSpeed's do); pread/pwrite(buffer, filename, validate, async, file_offset); read/write return 0;
new_cpu_locked_tensor / free_cpu_locked_tensor / is_pinned; the get_* accessors. Buffers that O_DIRECT
cannot use as they are (not on the CPU, not contiguous, or not 4 KiB aligned) go through a bounce buffer
from a pinned pool and are copied back when the op completes, as DeepSpeed does for unpinned buffers.

Deliberate differences (errors are never silent here):
- Failures raise instead of DeepSpeed's ``assert`` (which aborts the process), printed message and -1, or
  unchecked completion: a failed op raises OSError (errno, filename) from wait() after every queued op has
  drained; bad arguments (a size not divisible by intra_op_parallelism, read() of a buffer whose size is not
  the file's) raise ValueError; reading past the end of a file raises OSError(ENODATA) at submission.
- wait() with nothing queued returns 0 (DeepSpeed asserts, aborting the process).
- Sizes that are not a multiple of the disk block are written and read exactly (DeepSpeed's O_DIRECT op
  fails silently on them and still counts the op).
- read()/write() bounce unaligned buffers too (DeepSpeed's do O_DIRECT on them as they are, and silently
  transfer nothing when they are not aligned); they do not print timings; validate=True compares with a
  buffered read and raises on a mismatch.
- A file offset that is not 4 KiB aligned is served by a buffered pread/pwrite at submission time.
- The file-descriptor form of async_pwrite (``async_pwrite(buffer, fd, file_offset)``, also with ``fd=``;
  DeepSpeed's FastFileWriter uses it with an O_DIRECT descriptor) writes synchronously through that
  descriptor, from a pinned 4 KiB aligned bounce copy when the buffer is not one itself (as DeepSpeed bounces
  unpinned buffers), and returns 0; the next wait() counts it. The descriptor stays open (the caller's).

Every keyword name of DeepSpeed's bindings is accepted, including its spelling ``example_tenosr`` in
new_cpu_locked_tensor and ``async`` in pread/pwrite (passed as ``**{"async": True}``).
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import threading
from typing import Callable, List, Optional, Tuple

import torch

from aidaptiv_ds.common.sizes import ALIGN, align_up
from aidaptiv_ds.engine.io import IOEngine, IORequest, PinnedPool

logger = logging.getLogger(__name__)

DEEPSPEED_ALIGNMENT = 512  # DeepSpeed's O_DIRECT_ALIGNMENT, which get_alignment() multiplies
BOUNCE_POOL_BYTES = 64 << 20  # per handle; a bounce larger than what is free gets its own allocation


class _LockedRegions:
    """Page-locked tensors from new_cpu_locked_tensor, process-wide like DeepSpeed's pinned-tensor manager
    (a tensor locked by one handle is pinned for every handle). Views of a region count as pinned."""

    def __init__(self):
        self._lock = threading.Lock()
        self._starts: List[int] = []
        self._regions: List[Tuple[int, int, PinnedPool]] = []  # (start, end, pool), sorted by start

    def add(self, tensor: torch.Tensor, pool: PinnedPool) -> None:
        start = tensor.data_ptr()
        with self._lock:
            i = bisect.bisect(self._starts, start)
            self._starts.insert(i, start)
            self._regions.insert(i, (start, start + pool.capacity, pool))

    def remove(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            i = bisect.bisect_left(self._starts, tensor.data_ptr())
            if i < len(self._starts) and self._starts[i] == tensor.data_ptr():
                del self._starts[i], self._regions[i]
                return True
        return False

    def contains(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            return i >= 0 and ptr + nbytes <= self._regions[i][1]


_locked = _LockedRegions()


class _Op:
    """A queued op: the engine request (None when it completed at submission) and what to do after it."""

    __slots__ = ("request", "finish")

    def __init__(self, request: Optional[IORequest], finish: Optional[Callable[[], None]] = None):
        self.request, self.finish = request, finish


class AioHandle:
    """Stand-in for DeepSpeed's aio_handle (see the module docstring for the few deliberate differences)."""

    def __init__(
        self,
        block_size: int = 1024 * 1024,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ):
        for name, value in (
            ("block_size", block_size),
            ("queue_depth", queue_depth),
            ("intra_op_parallelism", intra_op_parallelism),
        ):
            if int(value) < 1:
                raise ValueError(f"aio_handle {name} is {value}: expected a positive integer")
        self._block_size, self._queue_depth = int(block_size), int(queue_depth)
        self._single_submit, self._overlap_events = bool(single_submit), bool(overlap_events)
        self._intra_op_parallelism = int(intra_op_parallelism)
        # Our pieces are O_DIRECT blocks: round DeepSpeed's block size up to a 4 KiB multiple.
        engine_block = align_up(self._block_size)
        self._engine = IOEngine(
            block_size=engine_block,
            queue_depth=min(self._queue_depth, 4096),
            threads=max(4, self._intra_op_parallelism),
        )
        self._ops: List[_Op] = []
        self._lock = threading.Lock()
        self._bounce_pool: Optional[PinnedPool] = None

    # -- accessors (DeepSpeed's values) -------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        return self._intra_op_parallelism * DEEPSPEED_ALIGNMENT

    # -- pinned tensors -----------------------------------------------------------------------------
    def new_cpu_locked_tensor(
        self, num_elem: int, example_tensor: Optional[torch.Tensor] = None, **kwargs
    ) -> torch.Tensor:
        """A page-locked, 4 KiB aligned CPU tensor of num_elem elements of example_tensor's dtype. DeepSpeed
        0.19's binding names the second argument ``example_tenosr``; both spellings are accepted."""
        if "example_tenosr" in kwargs:
            if example_tensor is not None:
                raise TypeError(
                    "aio_handle.new_cpu_locked_tensor: example_tensor given twice "
                    "(as example_tensor and example_tenosr)"
                )
            example_tensor = kwargs.pop("example_tenosr")
        self._reject_unknown(kwargs)
        if example_tensor is None:
            raise TypeError("aio_handle.new_cpu_locked_tensor: missing argument example_tensor")
        nbytes = max(1, int(num_elem) * example_tensor.element_size())
        pool = PinnedPool(nbytes)
        tensor = pool.allocate(int(num_elem), example_tensor.dtype)
        _locked.add(tensor, pool)
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Forget a tensor from new_cpu_locked_tensor (its memory goes when the last view of it does)."""
        return _locked.remove(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """DeepSpeed's answer: torch-pinned, or page-locked by new_cpu_locked_tensor (views included)."""
        return bool(buffer.is_pinned()) or _locked.contains(buffer)

    # -- queued ops ---------------------------------------------------------------------------------
    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(
        self, buffer: torch.Tensor, filename=None, file_offset: int = 0, *, fd: Optional[int] = None
    ) -> int:
        """DeepSpeed's two overloads: (buffer, filename, file_offset) and (buffer, fd, file_offset), the
        descriptor given by position or as fd=."""
        if fd is not None and filename is not None:
            raise TypeError("aio_handle.async_pwrite takes a filename or an fd, not both")
        if fd is None and isinstance(filename, int) and not isinstance(filename, bool):
            fd, filename = filename, None
        if fd is not None:
            self._check_parallel(buffer, "write")
            self._write_fd(buffer, int(fd), int(file_offset))
            with self._lock:
                self._ops.append(_Op(None))
            return 0
        if filename is None:
            raise TypeError("aio_handle.async_pwrite: missing argument filename (or fd)")
        return self.pwrite(buffer, filename, False, True, file_offset)

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, False, file_offset)

    def pread(
        self,
        buffer: torch.Tensor,
        filename: str,
        validate: bool,
        async_op: Optional[bool] = None,
        file_offset: int = 0,
        **kwargs,
    ) -> int:
        """Queue a read of buffer.nbytes at file_offset; with async false, also wait() (returns its count)."""
        async_op = kwargs.pop("async", async_op)
        self._reject_unknown(kwargs)
        filename, offset = os.fspath(filename), int(file_offset)
        nbytes = self._check_parallel(buffer, "read")
        size = self._file_size(filename)
        if offset + nbytes > size:
            raise OSError(
                errno.ENODATA,
                f"read of {nbytes} bytes at offset {offset} from {filename} would pass "
                f"the end of the file ({size} bytes): read only bytes that were written",
                filename,
            )
        self._queue(self._submit(True, buffer, filename, offset, validate))
        return 0 if async_op else self.wait()

    def pwrite(
        self,
        buffer: torch.Tensor,
        filename: str,
        validate: bool,
        async_op: Optional[bool] = None,
        file_offset: int = 0,
        **kwargs,
    ) -> int:
        """Queue a write of buffer at file_offset (the file is created 0600 if missing, never truncated)."""
        async_op = kwargs.pop("async", async_op)
        self._reject_unknown(kwargs)
        self._check_parallel(buffer, "write")
        self._queue(self._submit(False, buffer, os.fspath(filename), int(file_offset), validate))
        return 0 if async_op else self.wait()

    def read(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Synchronous read of the whole file into buffer (whose size must be the file's); returns 0."""
        filename = os.fspath(filename)
        nbytes, size = buffer.numel() * buffer.element_size(), os.stat(filename).st_size
        if nbytes != size:
            raise ValueError(
                f"aio_handle.read: buffer has {nbytes} bytes but {filename} has {size}: read() "
                "reads a whole file into a buffer of the file's size"
            )
        self._run_alone(self._submit(True, buffer, filename, int(file_offset), validate))
        return 0

    def write(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Synchronous write of buffer; returns 0."""
        self._run_alone(self._submit(False, buffer, os.fspath(filename), int(file_offset), validate))
        return 0

    def wait(self) -> int:
        """Wait for every queued op; return how many completed. The first failure is raised after all
        have drained (and bounce buffers were released)."""
        with self._lock:
            ops, self._ops = self._ops, []
        first: Optional[BaseException] = None
        for op in ops:
            try:
                if op.request is not None:
                    op.request.wait()
                if op.finish is not None:
                    op.finish()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first
        return len(ops)

    # -- internals ----------------------------------------------------------------------------------
    @staticmethod
    def _file_size(filename: str) -> int:
        return os.stat(filename).st_size

    @staticmethod
    def _reject_unknown(kwargs) -> None:
        if kwargs:
            raise TypeError(f"aio_handle: unexpected arguments {sorted(kwargs)}")

    def _check_parallel(self, buffer: torch.Tensor, what: str) -> int:
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes % self._intra_op_parallelism:
            raise ValueError(
                f"aio_handle {what} of {nbytes} bytes is not divisible by intra_op_parallelism "
                f"{self._intra_op_parallelism}: pad the buffer or lower intra_op_parallelism"
            )
        return nbytes

    def _queue(self, op: _Op) -> None:
        with self._lock:
            self._ops.append(op)

    def _run_alone(self, op: _Op) -> None:
        if op.request is not None:
            op.request.wait()
        if op.finish is not None:
            op.finish()

    def _direct_ok(self, buffer: torch.Tensor) -> bool:
        return buffer.device.type == "cpu" and buffer.is_contiguous() and buffer.data_ptr() % ALIGN == 0

    def _bounce(self, buffer: torch.Tensor) -> torch.Tensor:
        """A pinned, aligned tensor of buffer's dtype and shape, from this handle's bounce pool."""
        nbytes = buffer.numel() * buffer.element_size()
        with self._lock:
            if self._bounce_pool is None:
                self._bounce_pool = PinnedPool(BOUNCE_POOL_BYTES)
            pool = self._bounce_pool
        flat = pool.try_allocate(buffer.numel(), buffer.dtype)
        if flat is None:  # larger than what is free: an allocation of its own, freed with the tensor
            flat = PinnedPool(max(1, nbytes)).allocate(buffer.numel(), buffer.dtype)
        return flat.view(buffer.shape)

    def _submit(self, is_read: bool, buffer: torch.Tensor, filename: str, offset: int, validate: bool) -> _Op:
        if offset % ALIGN:
            self._buffered_io(is_read, buffer, filename, offset)
            return _Op(None, self._validator(buffer, filename, offset) if validate else None)
        direct = self._direct_ok(buffer)
        target = buffer if direct else self._bounce(buffer)
        if is_read:
            request = self._engine.read_async(target, filename, offset)
        else:
            if not direct:
                target.copy_(buffer)
            request = self._engine.write_async(target, filename, offset)
        steps = []
        if is_read and not direct:
            steps.append(lambda: buffer.copy_(target))
        if validate:
            steps.append(self._validator(buffer, filename, offset))

        def finish():
            for step in steps:
                step()

        return _Op(request, finish if steps else None)

    @staticmethod
    def _host_bytes(buffer: torch.Tensor):
        return buffer.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()

    def _validator(self, buffer: torch.Tensor, filename: str, offset: int) -> Callable[[], None]:
        def validate():
            expected = self._host_bytes(buffer).tobytes()
            with open(filename, "rb") as f:
                f.seek(offset)
                actual = f.read(len(expected))
            if actual != expected:
                raise OSError(
                    errno.EIO,
                    f"validation of {len(expected)} bytes at offset {offset} of {filename} "
                    "failed: the file and the buffer differ; check the disk",
                    filename,
                )
            logger.info("aio_handle: validated %d bytes at offset %d of %s", len(expected), offset, filename)

        return validate

    def _buffered_io(self, is_read: bool, buffer: torch.Tensor, filename: str, offset: int) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        if is_read:
            fd = os.open(filename, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                data = bytearray()
                while len(data) < nbytes:
                    chunk = os.pread(fd, nbytes - len(data), offset + len(data))
                    if not chunk:
                        raise OSError(
                            errno.ENODATA,
                            f"read of {nbytes} bytes at offset {offset} from {filename} reached the end of the file",
                            filename,
                        )
                    data += chunk
            finally:
                os.close(fd)
            host = torch.frombuffer(data, dtype=torch.uint8).view(buffer.dtype).view(buffer.shape)
            buffer.copy_(host)
        else:
            fd = os.open(filename, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                self._pwrite_all(fd, self._host_bytes(buffer), offset)
            finally:
                os.close(fd)

    def _write_fd(self, buffer: torch.Tensor, fd: int, offset: int) -> None:
        # The descriptor may be O_DIRECT (DeepSpeed's FastFileWriter opens it so), which needs an aligned
        # buffer: write from a bounce copy unless the buffer is one itself.
        source = buffer if self._direct_ok(buffer) else self._bounce(buffer).copy_(buffer)
        try:
            self._pwrite_all(fd, self._host_bytes(source), offset)
        except OSError as e:
            advice = (
                "an O_DIRECT descriptor needs a size and offset that are multiples of the disk block"
                if e.errno == errno.EINVAL
                else "check that the descriptor is open for writing and the disk"
            )
            raise OSError(
                e.errno,
                f"write of {source.numel() * source.element_size()} bytes at offset {offset} "
                f"to descriptor {fd} failed: {e.strerror}: {advice}",
            ) from e

    @staticmethod
    def _pwrite_all(fd: int, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = os.pwrite(fd, view[done:], offset + done)
            if n == 0:  # never loop forever on a descriptor that accepts nothing
                raise OSError(errno.EIO, f"write at offset {offset + done} accepted no bytes: check the disk")
            done += n

    def __del__(self):
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
