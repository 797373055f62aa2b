"""The machine block of a benchmark row, and the lines that show one: host, CPU and its flags, cores, RAM, GPUs,
kernel, OS, Python, and the disk under the swap folder (device, model, rotational, file system). The facts are
read by :mod:`aidaptiv_ds.engine.machine` and :mod:`aidaptiv_ds.engine.disk`, where every reader degrades to
None rather than failing: a row with an unknown disk model is still a row. The field names are the rows' and
the committed rows' under bench/results: they stay."""

from __future__ import annotations

import os
import platform
import socket

from aidaptiv_ds.engine import machine
from aidaptiv_ds.engine.disk import disk_of


def machine_info(swap_dir: str) -> dict:
    """The row's machine block, its disk the one under ``swap_dir``."""
    return {
        "host": socket.gethostname(),
        "cpu": machine.cpu_model(),
        "cpu_flags": machine.cpu_flags(),
        "cores": machine.physical_cores(),
        "threads": os.cpu_count(),
        "ram_gb": round(machine.physical_ram_bytes() / 2**30, 1),
        "gpus": machine.gpus(),
        "kernel": platform.release(),
        "os": machine.os_name(),
        "python": platform.python_version(),
        "swap_disk": disk_of(swap_dir),
    }


def cpu_line(m: dict) -> str:
    """The CPU of a machine dict with its notable flags: 'AMD EPYC 7B13 (avx avx2 fma f16c; no avx512f ...)'.
    Rows from before flags were recorded say so."""
    cpu = m.get("cpu") or m.get("cpu_model") or "?"
    return f"{cpu} ({machine.flags_summary(m['cpu_flags']) if 'cpu_flags' in m else 'flags not recorded'})"


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
