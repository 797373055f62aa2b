"""What is known of this machine apart from its disks (those are :mod:`aidaptiv_ds.engine.disk`'s): the CPU and
its flags, the GPUs and their driver (the one place nvidia-smi is asked), memory (RAM, the memory cgroup's limit,
the locked-memory limit, transparent huge pages), the process limits, the OS, and what is built for it (the
engine, torch, the installed packages).

A fact that cannot be read is unknown (None, or []), never an error: a benchmark row with an unknown CPU model is
still a row. The harness's rows, the planner, the host budget (:mod:`aidaptiv_ds.config.host`) and
``aidaptiv-ds env`` read the machine here; nothing here imports the rest of the package but the engine's ``_C``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import resource
import shutil
import subprocess
from typing import Dict, Iterable, List, Optional


def read_fact(path: str) -> Optional[str]:
    """The stripped text of a small /proc, /sys or /etc file, or None when it is missing, unreadable or empty."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


# -- the CPU ----------------------------------------------------------------------------------------------
def _cpuinfo_value(*keys: str) -> Optional[str]:
    """The value of the first line of /proc/cpuinfo that starts with one of ``keys``."""
    for line in (read_fact("/proc/cpuinfo") or "").splitlines():
        if line.startswith(keys):
            return line.split(":", 1)[1].strip()
    return None


def kernel_cpu_model() -> Optional[str]:
    """The CPU's name as /proc/cpuinfo's "model name" gives it (x86; Arm kernels list none)."""
    return _cpuinfo_value("model name")


def cpu_model() -> Optional[str]:
    """The CPU's name: /proc/cpuinfo's, which is instant, else py-cpuinfo's (which may spawn a subprocess)."""
    name = kernel_cpu_model()
    if name:
        return name
    try:
        import cpuinfo

        return cpuinfo.get_cpu_info().get("brand_raw")
    except Exception:  # py-cpuinfo raises assorted errors on unusual CPUs
        return None


def cpu_flags() -> Optional[List[str]]:
    """The CPU's feature flags as the kernel lists them (x86 "flags", Arm "Features"), sorted; None when unknown.
    Recorded because results depend on them: DeepSpeed's CPU accelerator, for one, picks fp16 or bf16 support
    from them, and CPU Adam's speed follows the vector width."""
    value = _cpuinfo_value("flags", "Features")
    return None if value is None else sorted(set(value.split()))


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


def physical_cores() -> Optional[int]:
    """Cores, not hardware threads (os.cpu_count() counts those); the thread count when psutil cannot tell."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count()


# -- the GPUs ---------------------------------------------------------------------------------------------
def nvidia_smi(*fields: str) -> List[str]:
    """nvidia-smi's answer to ``--query-gpu=<fields>``: one line per GPU, the fields comma-separated without
    units; [] when there is no nvidia-smi or it fails (no driver, no GPU)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.strip().splitlines() if line.strip()]


def gpus() -> List[dict]:
    """[{name, memory_mb}] of the GPUs nvidia-smi lists, or [] when there is none."""
    found = []
    for line in nvidia_smi("name", "memory.total"):
        name, _, mem = line.rpartition(",")  # the memory is the last field; a name could hold a comma
        try:
            found.append({"name": name.strip(), "memory_mb": float(mem)})
        except ValueError:
            found.append({"name": line, "memory_mb": None})
    return found


def nvidia_driver() -> Optional[str]:
    """The NVIDIA driver's version, or None without one."""
    lines = nvidia_smi("driver_version")
    return lines[0] if lines else None


def cuda_memory_bytes() -> Optional[int]:
    """The memory of the first GPU torch sees, or None without CUDA (or with a broken CUDA install)."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # a broken CUDA install: a plan for the CPU, as without one
        pass
    return None


def cuda_device_count() -> int:
    """The GPUs torch sees, 0 without CUDA (or with a broken CUDA install, as :func:`cuda_memory_bytes`)."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except Exception:
        pass
    return 0


# -- memory -----------------------------------------------------------------------------------------------
def physical_ram_bytes() -> int:
    """The machine's RAM (what /proc/meminfo's MemTotal and psutil say), whatever a cgroup allows."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def own_cgroups(text: Optional[str] = None) -> Dict[str, str]:
    """{controller, or '' for cgroup v2: this process's cgroup path} from /proc/self/cgroup (or ``text``, in
    its format)."""
    out = {}
    for line in (text if text is not None else read_fact("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The tightest memory limit on this process's cgroup and its ancestors (v2 memory.max, or v1
    memory.limit_in_bytes), or None when there is none."""
    text = read_fact(proc_cgroup)
    if text is None:
        return None
    own = own_cgroups(text)
    candidates = []
    for base, name, path in (
        (root, "memory.max", own.get("")),  # cgroup v2
        (os.path.join(root, "memory"), "memory.limit_in_bytes", own.get("memory")),  # cgroup v1
    ):
        if path is None:
            continue
        path = path.strip("/")
        while True:
            text = read_fact(os.path.join(base, path, name)) or ""
            if text.isdigit() and int(text) < (1 << 60):  # v1 writes a huge number for "no limit"
                candidates.append(int(text))
            if not path:
                break
            path = os.path.dirname(path)
    return min(candidates) if candidates else None


def total_ram_bytes() -> int:
    """Memory this process may use: physical RAM, or its cgroup's limit when lower (a container, a SLURM
    job, a sweep's host cap), so that a budget given as a share of RAM stays inside such a limit."""
    physical = physical_ram_bytes()
    limit = cgroup_memory_limit()
    return min(physical, limit) if limit else physical


def memlock_limit() -> Optional[int]:
    """The locked-memory limit (ulimit -l) in bytes that mlock and io_uring buffer registration are held to,
    or None when they are not (unlimited, or the process has CAP_IPC_LOCK)."""
    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        if int(caps, 16) & (1 << 14):  # CAP_IPC_LOCK
            return None
    except (OSError, ValueError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return None if soft == resource.RLIM_INFINITY else soft


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


# -- the process's limits and the OS ------------------------------------------------------------------------
def rlimit(which: int) -> dict:
    """{soft, hard} of one resource limit, each a number or "unlimited"."""

    def shown(value: int):
        return "unlimited" if value == resource.RLIM_INFINITY else value

    soft, hard = resource.getrlimit(which)
    return {"soft": shown(soft), "hard": shown(hard)}


def process_limits() -> Dict[str, dict]:
    """The limits this engine meets: locked memory (the pinned pool, io_uring's registered buffers), open files
    (one per swap file), file size (a swap file over it is an error, :mod:`aidaptiv_ds.engine.file_size_limit`)."""
    return {
        "memlock": rlimit(resource.RLIMIT_MEMLOCK),
        "open_files": rlimit(resource.RLIMIT_NOFILE),
        "file_size": rlimit(resource.RLIMIT_FSIZE),
    }


def os_name() -> Optional[str]:
    """The distribution's name as /etc/os-release's PRETTY_NAME gives it."""
    for line in (read_fact("/etc/os-release") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return None


# -- what is built for this machine -------------------------------------------------------------------------
def package_versions(names: Iterable[str]) -> Dict[str, Optional[str]]:
    """name -> installed version, None for one not installed (nothing is imported)."""
    versions: Dict[str, Optional[str]] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def engine_build() -> dict:
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


def torch_build() -> dict:
    """torch as built and as it sees this machine: its CUDA version, whether CUDA works, the devices it sees,
    and the compiler and C++ string ABI it was built with."""
    try:
        import torch
    except ImportError as e:
        return {"error": str(e)}
    out = {"cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "devices": []}
    # The compiler torch was built with (its build summary names it), beside the engine's: a C++ runtime
    # mismatch is the first thing to rule out in a crash report.
    m = re.search(r"^\s*-\s*((?:GCC|Clang|clang)\s+[\d.]+)", torch.__config__.show(), re.MULTILINE)
    out["compiler"] = m.group(1) if m else None
    out["cxx11_abi"] = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    if out["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out["devices"].append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    return out
