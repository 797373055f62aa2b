"""Facts about the machine a sweep runs on, recorded in every row: host, CPU and its flags, cores, RAM, GPUs, kernel,
and the disk under the swap folder (device, model, rotational, file system). Every probe degrades to None
rather than failing: a row with an unknown disk model is still a row."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from typing import Optional

import psutil


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def cpu_model() -> Optional[str]:
    # /proc/cpuinfo is instant; py-cpuinfo (which may spawn a subprocess) is the fallback elsewhere.
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    try:
        import cpuinfo

        return cpuinfo.get_cpu_info().get("brand_raw")
    except Exception:  # py-cpuinfo raises assorted errors on unusual CPUs
        return None


def cpu_flags() -> Optional[list[str]]:
    """The CPU's feature flags as the kernel lists them (x86 "flags", Arm "Features"), sorted; None when unknown.
    Recorded because results depend on them: DeepSpeed's CPU accelerator, for one, picks fp16 or bf16 support
    from them, and CPU Adam's speed follows the vector width."""
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return sorted(set(line.split(":", 1)[1].split()))
    return None


# The flags that change what runs or how fast, shown in a result's machine line (the row keeps them all).
NOTABLE_X86 = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
NOTABLE_ARM = ("asimd", "sve", "bf16")


def flags_summary(flags: Optional[list]) -> str:
    """'avx avx2 fma f16c; no avx512f ...' for x86 (the same for Arm's asimd, sve, bf16); 'flags unknown'
    when none were read."""
    if not flags:
        return "flags unknown"
    have = set(flags)
    names = NOTABLE_ARM if "asimd" in have else NOTABLE_X86
    yes = [f for f in names if f in have]
    no = [f for f in names if f not in have]
    return " ".join(yes) + (f"; no {' '.join(no)}" if no else "")


def cpu_line(m: dict) -> str:
    """The CPU of a machine dict with its notable flags: 'AMD EPYC 7B13 (avx avx2 fma f16c; no avx512f ...)'.
    Rows from before flags were recorded say so."""
    cpu = m.get("cpu") or m.get("cpu_model") or "?"
    return f"{cpu} ({flags_summary(m['cpu_flags']) if 'cpu_flags' in m else 'flags not recorded'})"


def gpus() -> list[dict]:
    """[{name, memory_mb}] from nvidia-smi, or [] when there is none."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        name, _, mem = line.rpartition(",")
        try:
            found.append({"name": name.strip(), "memory_mb": float(mem)})
        except ValueError:
            found.append({"name": line.strip(), "memory_mb": None})
    return found


def _mount_of(path: str) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """(mount point, file system type, source) of the mount holding path, from /proc/self/mountinfo."""
    best = (None, None, None)
    text = _read("/proc/self/mountinfo") or ""
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 2:
            continue
        mnt = fields[4].replace("\\040", " ")
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and (best[0] is None or len(mnt) >= len(best[0])):
            best = (mnt, rfields[0], rfields[1])
    return best


def disk_of(path: str) -> dict:
    """Device, model, rotational flag and file system of the disk holding ``path`` (or its nearest existing
    parent: the swap folder does not exist before the first cell)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != "/":
        p = os.path.dirname(p)
    p = os.path.realpath(p)
    mount, fstype, source = _mount_of(p)
    info = {
        "path": os.path.abspath(path),
        "mount": mount,
        "filesystem": fstype,
        "source": source,
        "device": None,
        "model": None,
        "rotational": None,
        "size_gb": None,
    }
    try:
        st = os.stat(p)
    except OSError:
        return info
    sysdev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not os.path.exists(sysdev):
        return info  # overlay, tmpfs, NFS, Lustre: no local block device behind it
    real = os.path.realpath(sysdev)
    disk = os.path.dirname(real) if os.path.exists(os.path.join(real, "partition")) else real
    info["device"] = os.path.basename(disk)
    model = _read(os.path.join(disk, "device", "model"))
    if model is None and os.path.basename(disk).startswith("vd"):
        model = "virtio disk"
    info["model"] = model
    rot = _read(os.path.join(disk, "queue", "rotational"))
    info["rotational"] = None if rot is None else rot == "1"
    sectors = _read(os.path.join(disk, "size"))
    info["size_gb"] = None if sectors is None else round(int(sectors) * 512 / 1e9, 1)
    return info


def machine_info(swap_dir: str) -> dict:
    vm = psutil.virtual_memory()
    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": psutil.cpu_count(logical=False) or os.cpu_count(),
        "threads": os.cpu_count(),
        "ram_gb": round(vm.total / 2**30, 1),
        "gpus": gpus(),
        "kernel": platform.release(),
        "os": _os_name(),
        "python": platform.python_version(),
        "swap_disk": disk_of(swap_dir),
    }


def _os_name() -> Optional[str]:
    text = _read("/etc/os-release") or ""
    for line in text.splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return None


def summary(m: dict) -> str:
    """One line for a report header."""
    kinds: dict[str, int] = {}
    for x in m.get("gpus") or []:
        name = f"{x['name']} {x['memory_mb'] / 1024:.0f} GiB" if x.get("memory_mb") else x["name"]
        kinds[name] = kinds.get(name, 0) + 1
    gpu = ", ".join(f"{n}x {name}" for name, n in kinds.items()) or "no GPU"
    d = m.get("swap_disk") or {}
    disk = (
        f"{d.get('device') or d.get('source') or '?'} ({d.get('model') or 'unknown model'}, "
        f"{'rotational' if d.get('rotational') else 'non-rotational' if d.get('rotational') is False else '?'}"
        f", {d.get('filesystem') or '?'})"
    )
    return (
        f"{m.get('host')}: {cpu_line(m)}, {m.get('cores')} cores, {m.get('ram_gb')} GiB RAM, {gpu}, "
        f"kernel {m.get('kernel')}, swap disk {disk}"
    )
