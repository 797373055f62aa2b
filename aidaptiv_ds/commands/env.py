"""What a bug report needs: this machine and this installation, in one block to paste.

    aidaptiv-ds env [--nvme-path DIR] [--json]

Package versions (aidaptiv-ds and its engine, torch, DeepSpeed, transformers, PEFT, accelerate, pydantic),
the CPU and its flags, GPUs and the driver, the swap disk under ``--nvme-path`` (mount, file system, block
device, free space, whether O_DIRECT works there, how many DMA segments and bytes a request may carry), the
memlock, open-file and file-size limits, the memory cgroup, the transparent huge page mode (whether the pinned pool
gets 2 MiB pages), and the rates this machine's cache holds (what ``aidaptiv-ds plan`` measured). Nothing is written;
nothing imports DeepSpeed (its version is read from the installed distribution).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
from typing import Optional

from aidaptiv_ds.commands import flags

PACKAGES = ("aidaptiv-ds", "torch", "deepspeed", "transformers", "peft", "accelerate", "pydantic", "safetensors")


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add(
        p,
        flags.NVME_PATH,
        default=".",
        help="the swap directory to describe (its nearest existing parent when it does not exist yet); default: .",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text block")


def _version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def engine_facts() -> dict:
    """The compiled engine: whether it imports, with the CUDA copy path or not, its O_DIRECT alignment, the
    compiler and C++ string ABI it was built with."""
    try:
        import torch  # noqa: F401  (the engine links against torch's libraries)

        from aidaptiv_ds.engine import _C
    except ImportError as e:
        return {"built": False, "error": str(e)}
    return {
        "built": True,
        "with_cuda": bool(_C.WITH_CUDA),
        "alignment": int(_C.ALIGNMENT),
        "compiler": getattr(_C, "COMPILER", None),
        "cxx11_abi": bool(_C.GLIBCXX_USE_CXX11_ABI) if hasattr(_C, "GLIBCXX_USE_CXX11_ABI") else None,
    }


def torch_facts() -> dict:
    try:
        import torch
    except ImportError as e:
        return {"error": str(e)}
    out = {"cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "devices": []}
    # The compiler torch was built with (its build summary names it), beside the engine's: a C++ runtime
    # mismatch is the first thing to rule out in a crash report.
    import re

    m = re.search(r"^\s*-\s*((?:GCC|Clang|clang)\s+[\d.]+)", torch.__config__.show(), re.MULTILINE)
    out["compiler"] = m.group(1) if m else None
    out["cxx11_abi"] = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    if out["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out["devices"].append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    return out


def nvidia_driver() -> Optional[str]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _limit(which: int) -> dict:
    soft, hard = resource.getrlimit(which)
    fmt = lambda v: "unlimited" if v == resource.RLIM_INFINITY else v
    return {"soft": fmt(soft), "hard": fmt(hard)}


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_page_facts(path: str = THP_ENABLED) -> dict:
    """The transparent huge page mode, and what it means for the pinned pool (which asks for huge pages: a 1 MiB
    I/O piece is then one DMA segment and neighbours merge into larger requests)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        mode = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        mode = None
    if mode in ("always", "madvise"):
        pool = "2 MiB huge pages"
    else:
        pool = (
            "4 KiB pages (transparent huge pages are off or absent): reads and writes through the pool can run at "
            f"half speed on disks that take few segments a request; set {path} to madvise"
        )
    return {"transparent_huge_pages": mode, "pinned_pool_pages": pool}


def _queue_limits(device: Optional[str]) -> dict:
    """The block device's request limits: a request longer than max_segments DMA segments is split."""
    from aidaptiv_ds.harness.machine import _read

    out = {}
    for key in ("max_segments", "max_sectors_kb"):
        text = _read(f"/sys/block/{device}/queue/{key}") if device else None
        out[key] = int(text) if text and text.isdigit() else None
    return out


def disk_facts(path: str) -> dict:
    """The swap disk under ``path``: what the sweep records of it, its free space, and the O_DIRECT check."""
    from aidaptiv_ds.engine.disk import UnsuitableDisk, check_dir
    from aidaptiv_ds.harness.machine import disk_of

    info = disk_of(path)
    info.update(_queue_limits(info.get("device")))
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    try:
        info["free_gb"] = round(shutil.disk_usage(probe).free / 1e9, 1)
    except OSError as e:
        info["free_gb"] = None
        info["free_error"] = str(e)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mounts = f.read()
        check_dir(probe, mounts)
        info["o_direct"] = "works"
    except UnsuitableDisk as e:
        info["o_direct"] = str(e)
    except OSError as e:
        info["o_direct"] = f"not checked ({e.strerror or e})"
    return info


def cached_rates() -> dict:
    from aidaptiv_ds.engine.machine_cache import cache_path, load_cache

    return {"file": cache_path(), "entries": load_cache()}


def collect(nvme_path: str) -> dict:
    from aidaptiv_ds.config.host import _cgroup_memory_limit, memlock_limit, total_ram_bytes
    from aidaptiv_ds.harness.machine import cpu_flags, cpu_model, flags_summary

    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "os": f"{platform.system()} {platform.release()}",
        "packages": {name: _version(name) for name in PACKAGES},
        "engine": engine_facts(),
        "torch": torch_facts(),
        "nvidia_driver": nvidia_driver(),
        "cpu": {"model": cpu_model(), "cores": os.cpu_count(), "notable_flags": flags_summary(cpu_flags())},
        "memory": {
            "ram_gib": round(total_ram_bytes() / 2**30, 1),
            "cgroup_limit_gib": None if _cgroup_memory_limit() is None else round(_cgroup_memory_limit() / 2**30, 1),
            "memlock_bytes": memlock_limit(),
            **huge_page_facts(),
        },
        "limits": {
            "memlock": _limit(resource.RLIMIT_MEMLOCK),
            "open_files": _limit(resource.RLIMIT_NOFILE),
            "file_size": _limit(resource.RLIMIT_FSIZE),
        },
        "swap_disk": disk_facts(nvme_path),
        "cached_rates": cached_rates(),
    }


def render(facts: dict) -> str:
    """The facts as an indented text block (nested dicts become indented lines)."""
    lines = []

    def walk(obj, indent):
        for key, value in obj.items():
            if isinstance(value, dict) and value:
                lines.append(f"{'  ' * indent}{key}:")
                walk(value, indent + 1)
            else:
                shown = "none" if value is None or value == {} or value == [] else value
                lines.append(f"{'  ' * indent}{key}: {shown}")

    walk(facts, 0)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    facts = collect(args.nvme_path)
    print(json.dumps(facts, indent=1, default=str) if args.json else render(facts))
    return 0
