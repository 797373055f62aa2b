"""Capping a cell's host memory, so that "it fits" means something on a machine with more RAM than the one
being emulated, and on CPU-only runs.

The cap covers the cell's whole process tree (launcher and every rank together). Three mechanisms, the
first that works is used (``--host-mem-cap-mechanism`` can force one), and the row records which:

- cgroup2: a child cgroup with ``memory.max`` = cap, ``memory.swap.max`` = 0 and ``memory.oom.group`` = 1,
  created under the nearest cgroup (ours or an ancestor) whose ``cgroup.subtree_control`` has the memory
  controller. The kernel OOM-kills the whole group when the cap is exceeded; ``memory.events`` counts it.
- cgroup1: a child of our own v1 memory cgroup with ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes``, so swap cannot extend it) = cap; ``memory.oom_control`` counts kills.
  (Hybrid hosts mount the memory controller only as v1.)
- rss-watchdog: the harness sums the RSS of the tree every 0.1 s (psutil) and kills the tree when it is over
  the cap. Coarser: an allocation burst shorter than the interval can overshoot, and shared pages count
  once per process.

A cgroup charges page cache too (as a real machine of that size would feel it); the watchdog does not.
The launcher joins the cgroup before exec through ``sh -c 'echo $$ > cgroup.procs && exec "$@"'``, so every
descendant starts inside it.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Optional

from aidaptiv_ds.engine.disk import mount_table
from aidaptiv_ds.engine.machine import own_cgroups

MECHANISMS = ("auto", "cgroup2", "cgroup1", "rss-watchdog")


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class CellCgroup:
    """One cell's memory cgroup (v1 or v2)."""

    def __init__(self, kind: str, path: str, limit_bytes: int):
        self.kind, self.path, self.limit_bytes = kind, path, limit_bytes

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def wrap(self, cmd: list[str]) -> list[str]:
        """The command, started inside this cgroup."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', self.procs_file, *cmd]

    def _counter(self, filename: str, name: str) -> int:
        for line in (_read(os.path.join(self.path, filename)) or "").splitlines():
            k, _, v = line.partition(" ")
            if k == name:
                return int(v)
        return 0

    def oom_kills(self) -> int:
        if self.kind == "cgroup2":
            return self._counter("memory.events", "oom_kill")  # processes killed, group kills included
        return self._counter("memory.oom_control", "oom_kill")

    def peak_bytes(self) -> Optional[int]:
        raw = _read(os.path.join(self.path, "memory.peak" if self.kind == "cgroup2" else "memory.max_usage_in_bytes"))
        try:
            return int(raw) if raw else None
        except ValueError:
            return None

    def pids(self) -> list[int]:
        return [int(p) for p in (_read(self.procs_file) or "").split()]

    def kill_all(self) -> None:
        if self.kind == "cgroup2" and os.path.exists(os.path.join(self.path, "cgroup.kill")):
            try:
                _write(os.path.join(self.path, "cgroup.kill"), "1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, wait_s: float = 10.0) -> None:
        """Kill whatever is left inside and delete the cgroup (rmdir fails while processes remain)."""
        deadline = time.monotonic() + wait_s
        while True:
            self.kill_all()
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)


class CgroupFactory:
    """Where cell cgroups are made, found once per sweep by ``probe_cgroup``."""

    def __init__(self, kind: str, parent: str):
        self.kind, self.parent = kind, parent

    def create(self, name: str, limit_bytes: int) -> CellCgroup:
        path = os.path.join(self.parent, name)
        if os.path.isdir(path):
            CellCgroup(self.kind, path, limit_bytes).remove()  # left over by a killed sweep
        os.mkdir(path)
        cg = CellCgroup(self.kind, path, limit_bytes)
        try:
            if self.kind == "cgroup2":
                _write(os.path.join(path, "memory.max"), str(limit_bytes))
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    _write(os.path.join(path, "memory.swap.max"), "0")
                if os.path.exists(os.path.join(path, "memory.oom.group")):
                    _write(os.path.join(path, "memory.oom.group"), "1")
            else:
                _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
                memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):  # only with swap accounting; must not be below memory.limit
                    _write(memsw, str(limit_bytes))
        except OSError:
            cg.remove()
            raise
        return cg


def _probe_v2(mounts_text: Optional[str] = None, cgroup: Optional[str] = None) -> tuple[Optional[CgroupFactory], str]:
    """The nearest cgroup, ours or an ancestor, whose children get the memory controller. (Ours usually has
    processes, and a v2 cgroup with processes cannot enable controllers for children, so the cell cgroup is
    often made beside ours.)"""
    mounts = [m["mountpoint"] for m in mount_table(mounts_text) if m["fstype"] == "cgroup2"]
    own = own_cgroups(cgroup).get("")
    if not mounts or own is None:
        return None, "no cgroup2 mount"
    why = "cgroup2 has no memory controller"
    for mnt in mounts:
        d = os.path.normpath(mnt + own)
        if not os.path.isdir(d):
            d = mnt  # inside a cgroup namespace the mount root is our own root
        while True:
            ctl = (_read(os.path.join(d, "cgroup.subtree_control")) or "").split()
            if "memory" in ctl:
                return CgroupFactory("cgroup2", d), d
            if os.path.normpath(d) == os.path.normpath(mnt):
                break
            d = os.path.dirname(d)
    return None, why


def _probe_v1(mounts_text: Optional[str] = None, cgroup: Optional[str] = None) -> tuple[Optional[CgroupFactory], str]:
    mounts = [
        m["mountpoint"]
        for m in mount_table(mounts_text)
        if m["fstype"] == "cgroup" and "memory" in m["options"].split(",")
    ]
    own = own_cgroups(cgroup).get("memory")
    if not mounts or own is None:
        return None, "no cgroup v1 memory controller"
    d = os.path.normpath(mounts[0] + own)
    if not os.path.isdir(d):
        d = mounts[0]
    return CgroupFactory("cgroup1", d), d


def probe_cgroup(mechanism: str = "auto") -> tuple[Optional[CgroupFactory], str]:
    """A factory for cell cgroups, or (None, why not). Tries to create and remove a test cgroup, so a
    read-only /sys/fs/cgroup or a missing controller is found before the first cell."""
    reasons = []
    for kind, probe in (("cgroup2", _probe_v2), ("cgroup1", _probe_v1)):
        if mechanism not in ("auto", kind):
            continue
        factory, where = probe()
        if factory is None:
            reasons.append(where)
            continue
        try:
            cg = factory.create(f"aidaptiv-ds-probe-{os.getpid()}", 1 << 30)
            cg.remove()
            return factory, where
        except OSError as e:
            reasons.append(f"{kind} at {where} not usable ({e.strerror or e})")
    return None, "; ".join(reasons) or "no cgroup"


def host_cap(gb: Optional[float], mechanism: str):
    """The sweep's host-cap settings {gb, mechanism, detail, factory}, or a sentence saying why the forced
    mechanism cannot be used."""
    cap = {"gb": gb, "mechanism": None, "detail": None, "factory": None}
    if not gb:
        return cap
    if mechanism == "rss-watchdog":
        cap.update(mechanism="rss-watchdog", detail="chosen with --host-mem-cap-mechanism")
    else:
        factory, where = probe_cgroup(mechanism)
        if factory is not None:
            cap.update(mechanism=factory.kind, detail=where, factory=factory)
        elif mechanism == "auto":
            cap.update(mechanism="rss-watchdog", detail=f"no usable cgroup: {where}")
        else:
            return f"--host-mem-cap-mechanism {mechanism} is not usable here: {where}"
    print(f"host memory cap {gb:g} GiB per cell via {cap['mechanism']} ({cap['detail']})", file=sys.stderr)
    return cap
