"""Where a job will write, checked before it starts: a folder it fills (and makes when missing), a file it writes.

A job that learns only at its end that its output folder is read-only has lost every step before it. So every
place a job writes is tried first, the way the write itself will meet it: :func:`probe` creates a file in the
folder and removes it. That is what a read-only bind mount or file system (EROFS) refuses even to root, who
passes every permission check (``os.access`` says yes to root for a folder of mode 0500, and nothing about a
quota or an NFS server's root squash). Nothing is left behind: the file is unnamed (``O_TMPFILE``) where the
file system has them, else named, private and unlinked at once.

A folder that does not exist yet is checked at its nearest existing parent, where it will be made; a path
through a regular file cannot be made at all. Every problem is one sentence that names the setting (in
backquotes, as the library's errors do) and the path; ``None`` when there is none.
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Optional


def nearest_existing(path: str) -> str:
    """``path`` made absolute, or its nearest parent that exists (a folder the job makes when missing)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != "/":
        p = os.path.dirname(p)
    return p


def probe(folder: str, direct: bool = False) -> None:
    """Create a file in ``folder`` and remove it; raises the OSError the system gives (EROFS, EACCES, ENOSPC,
    EINVAL for O_DIRECT with ``direct``, ...). Nothing is left behind."""
    flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    unnamed = getattr(os, "O_TMPFILE", 0)
    if unnamed:
        try:
            os.close(os.open(folder, flags | unnamed, 0o600))
            return
        except OSError as e:
            # No O_TMPFILE on this file system (EOPNOTSUPP; EISDIR on kernels before 3.11) or, with O_DIRECT,
            # perhaps no O_DIRECT (EINVAL): the named file below says which.
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    name = os.path.join(folder, f".aidaptiv-probe-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.close(fd)
    finally:
        os.unlink(name)


def errno_words(e: OSError) -> str:
    """``EROFS`` and the system's words for it: 'EROFS: Read-only file system'."""
    name = errno.errorcode.get(e.errno or 0, f"errno {e.errno}")
    return f"{name}: {e.strerror or os.strerror(e.errno or 0)}"


def refusal(e: OSError, what: str = "folder") -> str:
    """Why a folder refused a file, as the end of a sentence about it (starting with 'is')."""
    if e.errno == errno.EROFS:
        return f"is on a read-only file system (EROFS): remount it read-write or choose a {what} on a writable disk"
    if e.errno in (errno.EACCES, errno.EPERM):
        name = errno.errorcode[e.errno]
        return f"is not writable ({name}): choose a {what} you own or fix its permissions"
    return f"does not take a new file ({errno_words(e)}): choose another {what}"


def write_problem(folder: str) -> Optional[str]:
    """Why an existing ``folder`` cannot take a new file (the end of a sentence, starting with 'is'), or None."""
    try:
        probe(folder)
    except OSError as e:
        return refusal(e)
    return None


def folder_problem(path: str, what: str) -> Optional[str]:
    """Why the job cannot write into the folder ``path`` (made, with its parents, when missing), or None.
    ``what`` names the setting: `` `save_dir` ``."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{what} {path} is a file, not a folder: give a folder (it is made when missing)"
    where = nearest_existing(path)
    if not os.path.isdir(where):
        return f"{what} {path} cannot be made because {where} is a file, not a folder: give a path under a folder"
    reason = write_problem(where)
    if reason is None:
        return None
    if where == path:
        return f"{what} {path} {reason}"
    return f"{what} {path} would be made in {where}, which {reason}"


def file_problem(path: str, what: str) -> Optional[str]:
    """Why the job cannot write the file ``path`` (its folder made when missing), or None. ``what`` names the
    setting: `` `metrics_out` ``."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return f"{what} {path} is a folder: give a file name"
    folder = os.path.dirname(path)
    where = nearest_existing(folder)
    if not os.path.isdir(where):
        return f"{what} {path} cannot be written because {where} is a file, not a folder: give a path under a folder"
    reason = write_problem(where)
    if reason is not None:
        return f"{what} {path} cannot be written: its folder {where} {reason}"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{what} {path} is read-only (EACCES): make it writable or give another file name"
    return None
