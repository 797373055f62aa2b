"""What a bug report needs: this machine and this installation, in one block to paste.

    aidaptiv-ds env [--nvme-path DIR] [--json]

Package versions (aidaptiv-ds and its engine, torch, DeepSpeed, transformers, PEFT, accelerate, pydantic),
the CPU and its flags, GPUs and the driver, the swap disk under ``--nvme-path`` (mount, file system, block
device, free space, whether O_DIRECT works there, how many DMA segments and bytes a request may carry), the
memlock, open-file and file-size limits, the memory cgroup, the transparent huge page mode (whether the pinned pool
gets 2 MiB pages), and the rates this machine's cache holds (what ``aidaptiv-ds plan`` measured). Nothing is written;
nothing imports DeepSpeed (its version is read from the installed distribution). The facts are read where the
package reads them (:mod:`aidaptiv_ds.engine.machine`, :mod:`aidaptiv_ds.engine.disk`, the rate cache); this
command only puts them in one block, as text or JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from aidaptiv_ds.commands import flags
from aidaptiv_ds.engine import disk, machine
from aidaptiv_ds.engine.machine_cache import cache_path, load_cache

PACKAGES = ("aidaptiv-ds", "torch", "deepspeed", "transformers", "peft", "accelerate", "pydantic", "safetensors")


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add(
        p,
        flags.NVME_PATH,
        default=".",
        help="the swap directory to describe (its nearest existing parent when it does not exist yet); default: .",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text block")


def collect(nvme_path: str) -> dict:
    """The facts, as :mod:`aidaptiv_ds.engine.machine` and :mod:`aidaptiv_ds.engine.disk` read them."""
    cgroup_limit = machine.cgroup_memory_limit()
    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "os": f"{platform.system()} {platform.release()}",
        "packages": machine.package_versions(PACKAGES),
        "engine": machine.engine_build(),
        "torch": machine.torch_build(),
        "nvidia_driver": machine.nvidia_driver(),
        "cpu": {
            "model": machine.cpu_model(),
            "cores": os.cpu_count(),
            "notable_flags": machine.flags_summary(machine.cpu_flags()),
        },
        "memory": {
            "ram_gib": round(machine.total_ram_bytes() / 2**30, 1),
            "cgroup_limit_gib": None if cgroup_limit is None else round(cgroup_limit / 2**30, 1),
            "memlock_bytes": machine.memlock_limit(),
            **machine.huge_page_facts(),
        },
        "limits": machine.process_limits(),
        "swap_disk": disk.disk_facts(nvme_path),
        "cached_rates": {"file": cache_path(), "entries": load_cache()},
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
