"""The swap space on disk: :class:`SwapSpace` owns one runtime's folder under the rank's directory, locked for
the life of the job (a second job on the same path fails, naming the holder), with directories 0700, files
0600 created with O_EXCL, no symlinks followed, no reuse of files another user owns, nothing written outside
the configured path, and files removed at close unless kept; :class:`SwapFile` is one such file with a bump
allocator of 4 KiB-aligned :class:`Extent` s, grown with ``posix_fallocate`` in :data:`GROW_STEP` steps so
that a full disk is reported at allocation time."""

from __future__ import annotations

import bisect
import errno
import fcntl
import itertools
import logging
import os
import shutil
import socket
import stat
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from aidaptiv_ds.common.sizes import (  # the swappers import these two from here too
    SWAP_FILE_GROW_STEP,
    align_up,
)
from aidaptiv_ds.engine.file_size_limit import check_growth, efbig_not_sigxfsz
from aidaptiv_ds.engine.file_size_limit import limit as file_size_limit
from aidaptiv_ds.engine.io import IOEngine

log = logging.getLogger(__name__)


# The file grows in steps of this size (or the extent, if larger), so that allocating many small
# extents does not call posix_fallocate for each of them.
GROW_STEP = SWAP_FILE_GROW_STEP


@dataclass(frozen=True)
class Extent:
    """A 4 KiB-aligned range of a swap file: ``nbytes`` of payload in ``reserved`` bytes on disk."""

    file: "SwapFile"
    offset: int
    nbytes: int

    @property
    def reserved(self) -> int:
        return align_up(self.nbytes)

    @property
    def end(self) -> int:
        return self.offset + self.reserved


class SwapSpaceInUseError(OSError):
    """Another job holds the lock of a rank's swap folder."""


def _identity(st: os.stat_result) -> Tuple[int, int]:
    return st.st_dev, st.st_ino


def _holder_line() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = "?"
    return (
        f"pid {os.getpid()} on host {socket.gethostname()}, started {time.strftime('%Y-%m-%dT%H:%M:%S')}, "
        f"command: {command[:300]}"
    )


class _RankLock:
    """The lock of one rank's swap folder, held by this process for as long as any of its swap spaces there
    is open (two models built in one process share it; two processes never do).

    ``flock`` on ``<rank folder>/lock``: the kernel drops it when the holder dies, however it dies, so a
    free lock means no living job uses the folder, and only then are its files reclaimed. The file holds
    a line naming the holder, for the error a second job gets."""

    _held: Dict[str, "_RankLock"] = {}
    _guard = threading.Lock()

    def __init__(self, folder: str, fd: int):
        self.folder = folder
        self.fd = fd
        self.users = 0
        self._names = itertools.count()

    @classmethod
    def acquire(cls, folder: str) -> "_RankLock":
        with cls._guard:
            lock = cls._held.get(folder)
            if lock is None:
                lock = cls(folder, cls._lock_folder(folder))
                cls._held[folder] = lock
                lock._reclaim()
            lock.users += 1
            return lock

    @staticmethod
    def _lock_folder(folder: str) -> int:
        path = os.path.join(folder, "lock")
        for _ in range(20):
            # The holder removes the lock file (and the folder, when empty) as it ends: make both again.
            try:
                for d in (os.path.dirname(folder), folder):
                    SwapSpace._make_private_dir(d)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                continue
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise PermissionError(
                    errno.EPERM,
                    f"swap lock {path} is not a regular file of yours (uid "
                    f"{st.st_uid}): remove it or choose another nvme_path",
                    path,
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "holder not yet recorded"
                os.close(fd)
                raise SwapSpaceInUseError(
                    errno.EBUSY,
                    f"swap folder {folder} is in use by another job ({holder}): give each job its own "
                    "aidaptiv.nvme_path (a folder per run), or wait for that job to end",
                    folder,
                ) from None
            # Locked; but the previous holder may have removed this file between our open and our lock, in
            # which case a third job could lock a new file of the same name: hold the one the name leads to.
            try:
                same = _identity(os.lstat(path)) == _identity(st)
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (_holder_line() + "\n").encode(), 0)
                return fd
            os.close(fd)
        raise OSError(
            errno.EAGAIN,
            f"could not lock swap folder {folder}: its lock file kept being removed "
            "under us; check that no clean-up script works in aidaptiv.nvme_path",
            folder,
        )

    def _reclaim(self) -> None:
        """Remove what jobs that ended left in the folder (a crash, kept swap files): nobody holds the lock,
        so nobody uses them. Another user's files are never touched."""
        for name in sorted(os.listdir(self.folder)):
            if name == "lock":
                continue
            path = os.path.join(self.folder, name)
            st = os.lstat(path)
            if st.st_uid != os.geteuid():
                raise PermissionError(
                    errno.EPERM,
                    f"swap folder {self.folder} holds {name}, which belongs to uid "
                    f"{st.st_uid}: aidaptiv never removes another user's files; remove it or "
                    "choose another nvme_path",
                    path,
                )
            log.info("removing %s, left in the swap space by a job that has ended", path)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)  # does not follow symbolic links inside
            else:
                os.unlink(path)

    def new_folder_name(self) -> str:
        return f"p{os.getpid()}-{next(self._names)}"

    def release(self) -> None:
        with self._guard:
            self.users -= 1
            if self.users > 0:
                return
            del self._held[self.folder]
            # Removed while still locked (see _lock_folder), then unlocked by the close.
            try:
                os.unlink(os.path.join(self.folder, "lock"))
            except FileNotFoundError:
                pass
            os.close(self.fd)
            for d in (self.folder, os.path.dirname(self.folder)):
                try:
                    os.rmdir(d)
                except OSError:
                    pass  # not empty: another rank's folder, or kept files


class SwapSpace:
    """The swap folder of one runtime: ``<nvme_path>/aidaptiv-swap/rank<r>/p<pid>-<n>``.

    The rank's folder is locked for as long as the space is open, so a second job on the same nvme_path and
    rank fails at once (:class:`SwapSpaceInUseError`, naming the holder) instead of sharing files; spaces of
    one process (two models built in it) share the lock, each in a sub-folder of its own. What a job that
    ended left behind is removed when the lock is next taken."""

    def __init__(self, nvme_path: str, rank: int, keep_files: bool = False):
        self.nvme_path = os.path.realpath(nvme_path)
        self.rank = rank
        self.keep_files = keep_files
        self.rank_path = os.path.join(self.nvme_path, "aidaptiv-swap", f"rank{rank}")
        self.files: List[SwapFile] = []
        self.subdirs: List[str] = []
        self._lock: Optional[_RankLock] = _RankLock.acquire(self.rank_path)
        try:
            while True:
                self.path = os.path.join(self.rank_path, self._lock.new_folder_name())
                try:
                    os.mkdir(self.path, 0o700)
                    break
                except FileExistsError:
                    continue
        except BaseException:
            self._lock.release()
            raise

    def make_subdir(self, name: str) -> str:
        """A private folder ``name`` in this space's folder (0700, same rules as the folder itself), for a
        caller that must hand someone a path inside the swap space; removed with what it holds at close unless
        files are kept."""
        if not name or name in (".", "..") or os.sep in name:
            raise ValueError(f"swap sub-folder name {name!r}: expected one plain folder name")
        path = os.path.join(self.path, name)
        self._make_private_dir(path)
        if path not in self.subdirs:
            self.subdirs.append(path)
        return path

    @staticmethod
    def _make_private_dir(path: str) -> None:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                raise PermissionError(
                    errno.ELOOP,
                    f"swap directory {path} is a symbolic link: aidaptiv does not "
                    "follow links in its swap space; remove the link or choose another nvme_path",
                    path,
                ) from None
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(
                    errno.ENOTDIR,
                    f"swap directory {path} exists and is not a directory: remove it or choose another nvme_path",
                    path,
                ) from None
            if st.st_uid != os.geteuid():
                raise PermissionError(
                    errno.EPERM,
                    f"swap directory {path} belongs to uid {st.st_uid}, not to you "
                    f"(uid {os.geteuid()}): choose an nvme_path of your own",
                    path,
                ) from None
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(path, 0o700)

    def create_file(self, name: str, engine: IOEngine) -> "SwapFile":
        """Create ``name`` fresh (0600, O_EXCL) in this space's own folder."""
        path = os.path.join(self.path, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            # The folder was made empty by this space: something else put this here.
            owner = "" if st.st_uid == os.geteuid() else f", belongs to uid {st.st_uid}"
            raise PermissionError(
                errno.EPERM,
                f"swap file {path} already exists{owner}: aidaptiv never reuses "
                "files it did not create; remove it, and keep other programs out of nvme_path",
                path,
            )
        handle = engine.open(path, create=True, exclusive=True)
        try:
            f = SwapFile(path, handle, engine)
        except BaseException:
            engine.close(handle)
            raise
        self.files.append(f)
        return f

    def close(self) -> List[str]:
        """Close every file; remove them unless ``keep_files``; let go of the rank's lock. Returns the paths
        kept (a later job on this nvme_path and rank removes them when it starts)."""
        kept = []
        try:
            for f in self.files:
                f.close()
                if self.keep_files:
                    kept.append(f.path)
                else:
                    try:
                        os.unlink(f.path)
                    except FileNotFoundError:
                        pass
            self.files = []
            if not self.keep_files:
                self.subdirs = []
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        return kept


class SwapFile:
    """One preallocated swap file with a bump allocator of aligned extents and a free list.

    A descriptor of our own stays open beside the engine's, both to grow the file and to know which file
    this is: :meth:`reopen` refuses a path that no longer leads to it."""

    def __init__(self, path: str, handle, engine: IOEngine):
        self.path = path
        self.handle = handle
        self.engine = engine
        self.allocated = 0  # bytes handed out (high-water of the bump pointer)
        self.size = 0  # bytes preallocated on disk
        self._free: List[Tuple[int, int]] = []  # (offset, reserved) of released extents, by offset, merged
        self._lock = threading.Lock()
        # Opened by path right after the engine created the file with O_EXCL in a folder of ours (0700).
        self._fd: Optional[int] = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.identity = _identity(os.fstat(self._fd))

    def check_identity(self) -> None:
        """Raise when the path no longer leads to this file (deleted or replaced under the job)."""
        try:
            now = _identity(os.lstat(self.path))
        except FileNotFoundError:
            now = None
        if now != self.identity:
            what = "was deleted" if now is None else "was replaced by another file"
            raise OSError(
                errno.ESTALE,
                f"swap file {self.path} {what} while this job ran: something else works in "
                "aidaptiv.nvme_path (another job, a clean-up script); keep it out and resume "
                "from the last checkpoint",
                self.path,
            )

    def check_size(self, offset: int, nbytes: int, is_write: bool) -> None:
        """Raise when the file is shorter than what was preallocated: something truncated it under the job,
        and a read would find zeros (a hole, once a later write extends it again) or the end of the file."""
        if self._fd is None:
            return
        now = os.fstat(self._fd).st_size
        if now < self.size:
            what = "write to" if is_write else "read from"
            raise OSError(
                errno.ENODATA,
                f"{what} swap file {self.path} at offset {offset} ({nbytes} bytes) refused: "
                f"the file is {now} bytes but this job preallocated {self.size}, so it was "
                "truncated under the job (ENODATA) and its bytes are gone; keep other "
                "programs out of aidaptiv.nvme_path and resume from the last checkpoint",
                self.path,
            )

    def reopen(self, engine: IOEngine) -> None:
        """Move this file onto ``engine``: opened by path, accepted only if the path still leads to this file."""
        self.check_identity()
        handle = engine.open(self.path, create=False)
        try:
            self.check_identity()
        except OSError:
            engine.close(handle)
            raise
        old, old_engine = self.handle, self.engine
        self.handle, self.engine = handle, engine
        if old is not None:
            old_engine.close(old)

    def _grow(self, new_end: int) -> None:
        if new_end <= self.size:
            return
        target = max(new_end, min(self.size + GROW_STEP, align_up(new_end, GROW_STEP)))
        # Never past the file-size limit: growing past it sends SIGXFSZ (see file_size_limit).
        check_growth(self.path, new_end)
        lim = file_size_limit()
        if lim is not None:
            target = min(target, lim)
        fs = os.statvfs(self.path)
        free = fs.f_bavail * fs.f_frsize  # before the attempt: a failed fallocate may keep what it took
        try:
            with efbig_not_sigxfsz():
                os.posix_fallocate(self._fd, self.size, target - self.size)
        except OSError as e:
            if e.errno != errno.ENOSPC or target <= new_end:
                raise self._grow_error(e, target, free) from None
            # The step ahead does not fit but what is needed now may: the plan counts the bytes, not the steps.
            # First give back what the failed attempt took past the file's end (ext4 keeps those blocks).
            os.ftruncate(self._fd, self.size)
            try:
                with efbig_not_sigxfsz():
                    os.posix_fallocate(self._fd, self.size, new_end - self.size)
            except OSError as e2:
                raise self._grow_error(e2, new_end, free) from None
            target = new_end
        self.size = target

    def _grow_error(self, e: OSError, target: int, free: int) -> OSError:
        need = target - self.size
        return OSError(
            e.errno,
            f"cannot grow swap file {self.path} by {need / 2**30:.2f} GiB (to {target / 2**30:.2f} GiB): "
            f"{os.strerror(e.errno)}; the filesystem had {free / 2**30:.2f} GiB free before: free space or choose "
            "a larger nvme_path",
            self.path,
        )

    def allocate(self, nbytes: int) -> Extent:
        reserved = align_up(max(nbytes, 1))
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= reserved:
                    if size == reserved:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + reserved, size - reserved)
                    return Extent(self, off, nbytes)
            off = self.allocated
            self._grow(off + reserved)
            self.allocated = off + reserved
            return Extent(self, off, nbytes)

    def release(self, extent: Extent) -> None:
        """Give an extent back for reuse, merged with the free extents next to it: a layer group relocated
        at start (LoRA adapters are partitioned after the base, at the file's end) frees its partitions one
        by one, and only merged can they take the next group, so the file grows by about two groups instead
        of doubling (a 13B base once ran a 72 GB disk out of space). Space freed at the end of the live part
        shortens it (``allocated``), so a checkpoint, which copies that part, does not carry it."""
        with self._lock:
            start, end = extent.offset, extent.offset + extent.reserved
            i = bisect.bisect_left(self._free, (start, 0))
            if i > 0 and sum(self._free[i - 1]) == start:  # the free extent before ends where this one starts
                i -= 1
                start = self._free[i][0]
                self._free.pop(i)
            if i < len(self._free) and self._free[i][0] == end:  # the one after starts where this one ends
                end = sum(self._free.pop(i))
            if end == self.allocated:  # the file's live part ends before it (a checkpoint copies that part)
                self.allocated = start
                return
            self._free.insert(i, (start, end - start))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.handle is not None:
            self.engine.close(self.handle)
            self.handle = None
