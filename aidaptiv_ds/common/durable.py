"""Publishing a checkpoint folder so that a crash at any moment leaves the previous one or the new one.

A checkpoint is written into a *staging* folder beside its final name (``<save_dir>/.<tag>.saving``), every
file and folder of it fsync'd, and only then put in place with one rename (or, when the tag already exists,
one atomic exchange of the two folders, ``renameat2(RENAME_EXCHANGE)``), after which the parent folder is
fsync'd. ``latest`` is replaced the same way: a temporary file, fsync'd, renamed over it, parent fsync'd.
So ``latest`` never names a folder that is missing or half written, and a second save to an existing tag
swaps the whole folder rather than overwriting its files one by one.

Where the filesystem cannot exchange folders (NFS, some FUSE filesystems) the old folder is first renamed
to ``.<tag>.previous`` and the new one put in its place; a crash between those two renames leaves the tag
missing and its previous version complete under that name, which :func:`recover` (called before a load)
puts back.

The moments of a save are marked with :func:`crash_point`; nothing happens there unless a test installed a
hook with :func:`set_crash_hook` (tests/crash_hooks.py kills the process or snapshots the folder at a chosen
point). The package itself reads no environment variable for this: a user's job never kills itself.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from typing import Callable, Optional

log = logging.getLogger(__name__)

STAGING = ".{tag}.saving"
PREVIOUS = ".{tag}.previous"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100

_hook: Optional[Callable[[str], None]] = None


def set_crash_hook(hook: Optional[Callable[[str], None]]) -> None:
    """Run ``hook(label)`` at every :func:`crash_point` of this process (None: nothing runs there)."""
    global _hook
    _hook = hook


def hooks_active() -> bool:
    """Whether a crash hook is installed in this process."""
    return _hook is not None


def crash_point(label: str) -> None:
    """A moment of a save at which an installed crash hook (a test's) runs."""
    if _hook is not None:
        _hook(label)


def fsync_path(path: str) -> None:
    """fsync a file or a folder by name (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and folder under ``root`` (folders after their contents), ``root`` last."""
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = os.path.join(folder, name)
            if not os.path.islink(p):
                fsync_path(p)
        fsync_path(folder)


def write_text_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text``: a reader sees the old content or the new, never a part (temporary
    file in the same folder, fsync'd, renamed over ``path``, folder fsync'd)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    crash_point(f"{os.path.basename(path)}: temporary file written")
    os.replace(tmp, path)
    crash_point(f"{os.path.basename(path)}: renamed")
    fsync_path(folder)


def exchange(a: str, b: str) -> None:
    """Swap two existing paths atomically (Linux renameat2 RENAME_EXCHANGE). Raises OSError (EINVAL,
    ENOSYS, EOPNOTSUPP, ...) where the C library or the filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this C library", a)
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"renameat2(RENAME_EXCHANGE) failed: {os.strerror(e)}", a, None, b)


def staging_name(tag: str) -> str:
    return STAGING.format(tag=tag)


def begin(save_dir: str, tag: str) -> str:
    """Make ``save_dir`` and an empty staging folder for ``tag``; returns the staging folder's name (a tag,
    relative to ``save_dir``). What crashed saves left is removed first: staging folders, and previous
    versions whose tag is in place again. One process per folder calls it, and one job saves into a folder."""
    if not os.path.isdir(save_dir):
        os.makedirs(save_dir)
        fsync_path(os.path.dirname(os.path.abspath(save_dir)))  # the new folder's name, durable
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(".") and name.endswith(".saving"):
            shutil.rmtree(path, ignore_errors=True)
        elif (
            name.startswith(".")
            and name.endswith(".previous")
            and os.path.isdir(os.path.join(save_dir, name[1 : -len(".previous")]))
        ):
            shutil.rmtree(path, ignore_errors=True)  # a fallback publish whose clean-up was cut short
        elif name == ".latest.tmp":
            os.unlink(path)
    os.makedirs(os.path.join(save_dir, staging_name(tag)))
    crash_point("staging folder created")
    return staging_name(tag)


def publish(save_dir: str, tag: str, save_latest: bool) -> None:
    """Make the staging folder of ``tag`` durable and put it in place, then point ``latest`` at it."""
    staging = os.path.join(save_dir, staging_name(tag))
    final = os.path.join(save_dir, tag)
    fsync_tree(staging)
    crash_point("staging folder synced")
    if os.path.isdir(final):
        old = staging  # after the exchange the staging name holds the old folder
        try:
            exchange(staging, final)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
                raise
            old = os.path.join(save_dir, PREVIOUS.format(tag=tag))
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            crash_point("fallback: old folder moved aside")
            os.rename(staging, final)
        crash_point("folder exchanged")
        fsync_path(save_dir)
        crash_point("parent folder synced")
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, final)
        crash_point("folder renamed")
        fsync_path(save_dir)
        crash_point("parent folder synced")
    if save_latest:
        write_text_atomically(os.path.join(save_dir, "latest"), tag)
    crash_point("published")


def recover(load_dir: str, tag: str) -> None:
    """Before loading ``tag``: if a fallback publish was cut between its two renames, the tag's folder is
    missing and its previous version is complete under ``.<tag>.previous``: put it back."""
    final = os.path.join(load_dir, tag)
    previous = os.path.join(load_dir, PREVIOUS.format(tag=tag))
    if not os.path.exists(final) and os.path.isdir(previous):
        try:
            os.rename(previous, final)
            fsync_path(load_dir)
            log.warning("aidaptiv: %s was missing after an interrupted save; restored its previous version", final)
        except FileNotFoundError:
            pass  # another rank put it back first
