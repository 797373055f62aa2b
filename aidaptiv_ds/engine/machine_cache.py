"""The cache of what was measured on this machine (``$XDG_CACHE_HOME/aidaptiv-ds/rates.json``, ``~/.cache`` by
default, or ``$AIDAPTIV_DS_CACHE_DIR/rates.json``): where it is, reading and writing it, and the key of a disk.

One JSON object, one entry per measured thing: a disk (``disk:<major>:<minor>:<model>``: its bandwidths and
the I/O settings tuned for it), the CPUs, the framework's memory, a GPU. The planner's rate probes
(:mod:`aidaptiv_ds.planner.rates`) write it; the swapper reads the tuned I/O settings of its disk
(:mod:`aidaptiv_ds.engine.tuning`). Nothing here imports torch, DeepSpeed or the rest of the package's layers.
"""

from __future__ import annotations

import json
import os
from typing import Optional


def cache_path() -> str:
    """``$AIDAPTIV_DS_CACHE_DIR/rates.json`` when that is set (the test suite sets it, to run apart from the
    machine's cache), else ``$XDG_CACHE_HOME/aidaptiv-ds/rates.json`` (``~/.cache`` by default)."""
    own = os.environ.get("AIDAPTIV_DS_CACHE_DIR")
    if own:
        return os.path.join(own, "rates.json")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aidaptiv-ds", "rates.json")


def load_cache(path: Optional[str] = None) -> dict:
    path = path or cache_path()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_cache(entries: dict, path: Optional[str] = None) -> None:
    path = path or cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def disk_key(directory: str) -> str:
    """The cache key of the disk under ``directory``: its st_dev and the disk's model."""
    from aidaptiv_ds.engine.disk import block_device, disk_model

    st = os.stat(directory)
    dev = block_device(directory).get("device") or ""
    name = os.path.basename(dev)
    # The device may be a partition (nvme0n1p1, sda1); the model is its disk's.
    model = None
    for candidate in (name, name.rstrip("0123456789").rstrip("p")):
        model = disk_model(candidate)
        if model:
            break
    return f"disk:{os.major(st.st_dev)}:{os.minor(st.st_dev)}:{model or name or 'unknown'}"
