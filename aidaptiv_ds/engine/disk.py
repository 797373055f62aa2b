"""What is known of the disk under a folder: its mount (filesystem type, device), its block device, and
whether the folder can take O_DIRECT I/O at all (:func:`check_dir`); used by io-bench, the rate cache and
the planner."""

from __future__ import annotations

import os
from typing import Dict, Optional

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


class UnsuitableDisk(ValueError):
    """A folder whose disk cannot hold swap files or be measured: memory, or no O_DIRECT. One sentence that
    names the folder (the caller's parameter names its role)."""


# -- the machine and the disk -----------------------------------------------------------------------
def _unescape_mount(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_of(path: str, mounts_text: str) -> Dict[str, str]:
    """The mount holding path: {'mountpoint', 'fstype', 'source'}, by longest mountpoint prefix."""
    path = os.path.realpath(path)
    best = {"mountpoint": "/", "fstype": "unknown", "source": "unknown"}
    best_len = -1
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        source, mountpoint, fstype = _unescape_mount(fields[0]), _unescape_mount(fields[1]), fields[2]
        inside = path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) >= best_len:  # later mounts over the same point win
            best, best_len = {"mountpoint": mountpoint, "fstype": fstype, "source": source}, len(mountpoint)
    return best


def block_device(path: str) -> Dict[str, Optional[str]]:
    """The block device under path's filesystem (the whole disk for a partition), and whether it rotates."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dev = f"/sys/dev/block/{major}:{minor}"
    if major == 0 or not os.path.exists(sys_dev):
        return {"device": None, "rotational": None}
    node = os.path.realpath(sys_dev)
    name = os.path.basename(node)
    disk = os.path.basename(os.path.dirname(node)) if os.path.exists(os.path.join(node, "partition")) else name
    rotational = None
    try:
        with open(f"/sys/block/{disk}/queue/rotational") as f:
            rotational = f.read().strip() == "1"
    except OSError:
        pass
    return {"device": f"/dev/{name}", "rotational": rotational}


def check_dir(path: str, mounts_text: str) -> Dict[str, str]:
    """Refuse memory filesystems and filesystems that refuse O_DIRECT; return the mount."""
    mount = mount_of(path, mounts_text)
    if mount["fstype"] in MEMORY_FILESYSTEMS:
        raise UnsuitableDisk(
            f"{path} is on {mount['fstype']} (memory, not a disk): choose a directory on the disk (the SSD)"
        )
    probe = os.path.join(path, f".io-bench-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as e:
        why = "refuses O_DIRECT" if e.errno == 22 else f"cannot take a file ({e.strerror})"
        raise UnsuitableDisk(
            f"{path} is on {mount['fstype']}, which {why}: swap files and page-cache-free measurements need "
            "O_DIRECT; choose a directory on a disk filesystem such as ext4 or xfs"
        ) from None
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    return mount
