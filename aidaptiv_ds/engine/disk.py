"""What is known of this machine's disks: the mount table (the one reader of /proc/self/mounts), the mount and
block device under a folder (the whole disk's name, model, size, whether it rotates, how much one request may
carry), its free space, and whether the folder can take O_DIRECT I/O at all (:func:`check_dir`); and the one rule
for a swap folder that every command applies before it starts (:func:`swap_folder_problem`).

io-bench, the rate cache, the planner, the sweep's rows (:func:`disk_of`), the harness's host cap (the cgroup
mounts) and ``aidaptiv-ds env`` (:func:`disk_facts`) read the disks here; the rest of the machine is
:mod:`aidaptiv_ds.engine.machine`'s.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Dict, List, Optional, Tuple

from aidaptiv_ds.common.destinations import nearest_existing, probe, refusal
from aidaptiv_ds.engine.machine import read_fact

MOUNTS = "/proc/self/mounts"
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


class UnsuitableDisk(ValueError):
    """A folder that cannot hold swap files or be measured: missing, memory, no O_DIRECT, read-only. One sentence
    that names the folder (the caller's parameter names its role)."""


# -- mounts -----------------------------------------------------------------------------------------------
def _unescape_mount(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def read_mounts() -> str:
    """The text of /proc/self/mounts (OSError when it cannot be read: no /proc)."""
    with open(MOUNTS) as f:
        return f.read()


def mount_table(mounts_text: Optional[str] = None) -> List[Dict[str, str]]:
    """[{'source', 'mountpoint', 'fstype', 'options'}] in mount order, from ``mounts_text`` (/proc/self/mounts's
    format) or, when None, from /proc/self/mounts ([] when it cannot be read)."""
    if mounts_text is None:
        try:
            mounts_text = read_mounts()
        except OSError:
            mounts_text = ""
    table = []
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        table.append(
            {
                "source": _unescape_mount(fields[0]),
                "mountpoint": _unescape_mount(fields[1]),
                "fstype": fields[2],
                "options": fields[3] if len(fields) > 3 else "",
            }
        )
    return table


def mount_of(path: str, mounts_text: Optional[str] = None) -> Dict[str, str]:
    """The mount holding path: {'mountpoint', 'fstype', 'source'}, by longest mountpoint prefix, from
    ``mounts_text`` (/proc/self/mounts's format) or, when None, from /proc/self/mounts."""
    path = os.path.realpath(path)
    best = {"mountpoint": "/", "fstype": "unknown", "source": "unknown"}
    best_len = -1
    for m in mount_table(mounts_text):
        mountpoint = m["mountpoint"]
        inside = path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) >= best_len:  # later mounts over the same point win
            best, best_len = {"mountpoint": mountpoint, "fstype": m["fstype"], "source": m["source"]}, len(mountpoint)
    return best


# -- block devices ----------------------------------------------------------------------------------------
def _sys_nodes(path: str) -> Optional[Tuple[str, str]]:
    """The /sys nodes of the block device under path's file system and of its whole disk (the same node unless
    the device is a partition), or None when no local block device is behind it (overlay, tmpfs, NFS, Lustre)."""
    st = os.stat(path)
    sys_dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if os.major(st.st_dev) == 0 or not os.path.exists(sys_dev):
        return None
    node = os.path.realpath(sys_dev)
    return node, os.path.dirname(node) if os.path.exists(os.path.join(node, "partition")) else node


def block_device(path: str) -> Dict[str, Optional[str]]:
    """The block device under path's filesystem (the partition when it is one), and whether its disk rotates."""
    nodes = _sys_nodes(path)
    if nodes is None:
        return {"device": None, "rotational": None}
    node, disk = nodes
    rot = read_fact(f"/sys/block/{os.path.basename(disk)}/queue/rotational")
    return {"device": f"/dev/{os.path.basename(node)}", "rotational": None if rot is None else rot == "1"}


def disk_model(name: str) -> Optional[str]:
    """The model a whole disk (``nvme0n1``, ``sda``) reports in /sys, or None (virtio disks report none)."""
    return read_fact(f"/sys/block/{name}/device/model")


def queue_limits(disk: Optional[str]) -> Dict[str, Optional[int]]:
    """A whole disk's request limits: a request longer than max_segments DMA segments, or than max_sectors_kb,
    is split."""
    out = {}
    for key in ("max_segments", "max_sectors_kb"):
        text = read_fact(f"/sys/block/{disk}/queue/{key}") if disk else None
        out[key] = int(text) if text and text.isdigit() else None
    return out


def disk_of(path: str) -> dict:
    """Device, model, rotational flag and file system of the disk holding ``path`` (or its nearest existing
    parent: the swap folder does not exist before the first cell), as a benchmark row records it; every fact
    that cannot be read is None."""
    p = os.path.realpath(nearest_existing(path))
    mount = mount_of(p)
    info = {
        "path": os.path.abspath(path),
        "mount": mount["mountpoint"],
        "filesystem": mount["fstype"],
        "source": mount["source"],
        "device": None,
        "model": None,
        "rotational": None,
        "size_gb": None,
    }
    try:
        nodes = _sys_nodes(p)
    except OSError:
        return info
    if nodes is None:
        return info
    disk = nodes[1]
    info["device"] = os.path.basename(disk)
    model = disk_model(info["device"])
    if model is None and info["device"].startswith("vd"):
        model = "virtio disk"
    info["model"] = model
    rot = read_fact(os.path.join(disk, "queue", "rotational"))
    info["rotational"] = None if rot is None else rot == "1"
    sectors = read_fact(os.path.join(disk, "size"))
    info["size_gb"] = None if sectors is None else round(int(sectors) * 512 / 1e9, 1)
    return info


def _dir_refusal(path: str, mounts_text: Optional[str] = None) -> Tuple[Optional[str], Dict[str, str]]:
    """(why the existing folder ``path`` cannot hold swap files, as the end of a sentence starting with 'is',
    or None; its mount). The mount table is ``mounts_text`` (/proc/self/mounts's format), read here when None;
    without one (no /proc) only the file probe decides."""
    if mounts_text is None:
        try:
            mounts_text = read_mounts()
        except OSError:
            mounts_text = ""
    mount = mount_of(path, mounts_text)
    # By the mount table, not by a probe: tmpfs takes O_DIRECT on recent kernels (6.6), and is still memory.
    if mount["fstype"] in MEMORY_FILESYSTEMS:
        return (
            f"is on {mount['fstype']} (memory, not a disk): swap files need a disk that takes O_DIRECT, such as a "
            "directory on the SSD"
        ), mount
    try:
        probe(path, direct=True)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return (
                f"is on {mount['fstype']}, which refuses O_DIRECT (what swap files and page-cache-free "
                "measurements need): choose a directory on a disk filesystem such as ext4 or xfs"
            ), mount
        return refusal(e, "directory"), mount
    return None, mount


def check_dir(path: str, mounts_text: Optional[str] = None) -> Dict[str, str]:
    """Refuse (UnsuitableDisk) an existing folder on a memory filesystem, on one that refuses O_DIRECT, or that
    does not take a new file (read-only, not writable); return its mount. ``mounts_text`` is
    /proc/self/mounts's format, read here when None."""
    why, mount = _dir_refusal(path, mounts_text)
    if why:
        raise UnsuitableDisk(f"{path} {why}")
    return mount


def swap_folder_problem(path: str, made_by_job: bool = False, mounts_text: Optional[str] = None) -> Optional[str]:
    """Why ``path`` cannot be a swap folder, in one sentence that starts with it (the caller names the setting
    before it), or None. The one rule of every command that takes a swap folder (train, generate, plan,
    io-bench): it exists, is a directory, and :func:`check_dir` takes it (a disk, not memory; O_DIRECT; writable).
    ``made_by_job``: the job makes it when missing (train's ``create_nvme_path``; DeepSpeed's own ZeRO-Infinity
    swapper), so a missing folder is checked at its nearest existing parent, where it will be made."""
    path = os.path.abspath(path)
    where = path
    if not os.path.isdir(path):
        if os.path.exists(path):
            return f"{path} is not a directory: give a directory on the SSD"
        if not made_by_job:
            return f"{path} does not exist: create it on the SSD (mkdir -p {path}) or choose an existing directory"
        where = nearest_existing(path)
        if not os.path.isdir(where):
            return f"{path} cannot be made because {where} is a file, not a directory: give a path under a directory"
    why, _ = _dir_refusal(where, mounts_text)
    if why is None:
        return None
    return f"{path} {why}" if where == path else f"{path} would be made in {where}, which {why}"


def check_swap_folder(path: str, made_by_job: bool = False) -> None:
    """:func:`swap_folder_problem` as an UnsuitableDisk (a ValueError)."""
    problem = swap_folder_problem(path, made_by_job)
    if problem:
        raise UnsuitableDisk(problem)


def disk_facts(path: str) -> dict:
    """Everything known of the disk under ``path`` (or its nearest existing parent): what a row records of it
    (:func:`disk_of`), its request limits, its free space, and whether O_DIRECT works there ("works", or the
    sentence saying why not)."""
    info = disk_of(path)
    info.update(queue_limits(info.get("device")))
    where = nearest_existing(path)
    try:
        info["free_gb"] = round(shutil.disk_usage(where).free / 1e9, 1)
    except OSError as e:
        info["free_gb"] = None
        info["free_error"] = str(e)
    try:
        check_dir(where)
        info["o_direct"] = "works"
    except UnsuitableDisk as e:
        info["o_direct"] = str(e)
    except OSError as e:
        info["o_direct"] = f"not checked ({e.strerror or e})"
    return info
