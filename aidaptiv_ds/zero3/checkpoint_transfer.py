"""Moving a checkpoint's bytes between the swap files and the checkpoint's files: one pinned transfer buffer
(:class:`Mover`) and the engine, or plain positional reads and writes (:class:`BufferedFile`) on a filesystem
that refuses O_DIRECT. The format (what goes where) is :mod:`aidaptiv_ds.swap.checkpoint_format`'s, written and
loaded by :mod:`aidaptiv_ds.zero3.checkpoint`."""

from __future__ import annotations

import os

import torch

from aidaptiv_ds.common import durable
from aidaptiv_ds.swap.budget_split import TRANSFER_MIN

CHUNK = 64 * 1024 * 1024


class Mover:
    """Copies between a swap file and a checkpoint file through one pinned buffer."""

    def __init__(self, runtime):
        self.runtime = runtime
        # Up to CHUNK, and never more than an eighth of the budget (resident state may hold the rest); where
        # that much is not free (a LoRA run's pool is its slots and little else, whatever the budget), half as
        # much, down to TRANSFER_MIN, which the budget split always leaves room for.
        size = max(TRANSFER_MIN, min(CHUNK, runtime.memory.capacity // 8) // (1 << 20) * (1 << 20))
        buf = runtime.memory.try_take(size)
        while buf is None and size > TRANSFER_MIN:
            size = max(TRANSFER_MIN, size // 2 // (1 << 20) * (1 << 20))
            buf = runtime.memory.try_take(size)
        self.buf = buf if buf is not None else runtime.memory.take(size, "checkpoint transfer buffer")
        self.chunk = size

    def open(self, path: str, create: bool):
        try:
            return self.runtime.engine.open(path, create=create, exclusive=create)
        except OSError as e:
            if e.errno == 22:  # EINVAL: this filesystem refuses O_DIRECT (e.g. tmpfs)
                return BufferedFile(path, create)
            raise

    def copy(self, src, src_off: int, dst, dst_off: int, nbytes: int, inspect=None) -> None:
        """src/dst are engine files or BufferedFile; offsets of engine files are 4 KiB aligned. ``inspect``
        (a FileInspector's ``see``) is shown each block on its way to ``dst``."""
        done = 0
        while done < nbytes:
            n = min(self.chunk, nbytes - done)
            view = self.buf[:n]
            read_into(self.runtime, src, src_off + done, view)
            if inspect is not None:
                inspect(dst_off + done, view)
            write_from(self.runtime, dst, dst_off + done, view)
            done += n
            durable.crash_point(f"copied {done} of {nbytes} bytes")


class BufferedFile:
    """A checkpoint file through the page cache (where O_DIRECT is refused). Made durable by the caller's
    fsync of the whole folder before it is published."""

    def __init__(self, path: str, create: bool):
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | ((os.O_CREAT | os.O_EXCL) if create else 0)
        self.path = path
        self.fd = os.open(path, flags, 0o600)

    def close(self):
        os.close(self.fd)


def read_into(runtime, f, offset: int, view: torch.Tensor) -> None:
    if isinstance(f, BufferedFile):
        pread_into(f.fd, f.path, offset, view)
    else:
        runtime.engine.read(view, f, offset)


def pread_into(fd: int, path: str, offset: int, view: torch.Tensor) -> None:
    """Fill the uint8 tensor ``view`` with the bytes at ``offset`` of ``fd`` (no intermediate copy)."""
    mv = memoryview(view.numpy())
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n == 0:
            raise OSError(
                5,
                f"checkpoint file {path} is truncated: wanted {len(mv)} bytes at offset {offset}, "
                f"got {done}: the checkpoint is damaged, resume from another one",
                path,
            )
        done += n


def write_from(runtime, f, offset: int, view: torch.Tensor) -> None:
    if isinstance(f, BufferedFile):
        mv = memoryview(view.numpy())
        done = 0
        while done < len(mv):
            done += os.pwritev(f.fd, [mv[done:]], offset + done)
    else:
        runtime.engine.write(view, f, offset)


def close_file(runtime, f) -> None:
    if isinstance(f, BufferedFile):
        f.close()
    else:
        runtime.engine.close(f)
