"""Build DeepSpeed's just-in-time ops once, before the first cell.

DeepSpeed compiles some of its ops (CPU Adam, async_io, FusedAdam, the shared-memory communicator) the
first time a process needs them and caches them in TORCH_EXTENSIONS_DIR. Inside a cell that would count
against the cell's timeout, and under a host memory cap the compilers themselves are killed (a C++
compile takes about a GiB per job): a ZeRO-Infinity cell would be recorded as out of memory because of
its build. So the sweep builds what its backends need first, in a separate process with no cap
(``python -m aidaptiv_ds.zero3.op_builds NAMES``).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

# DeepSpeed op builders each backend's cells load (CPU or CUDA builders alike, by name).
OPS = {
    "zero3": ["FusedAdamBuilder", "ShareMemCommBuilder"],
    "zero3_cpu_offload": ["CPUAdamBuilder", "ShareMemCommBuilder"],
    "zero_infinity": ["CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder"],
    "zero_infinity_eqmem": ["CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder"],
    "aidaptiv": ["CPUAdamBuilder", "ShareMemCommBuilder"],
}

# The module that builds them, run as a process of its own (see the module docstring).
BUILD_MODULE = "aidaptiv_ds.zero3.op_builds"


def put_build_tools_first(env) -> None:
    """Put the directory of this Python's executables (the virtual environment's bin) first on ``env``'s
    PATH, once. torch compiles DeepSpeed's ops with whichever ``ninja`` PATH finds first, and ninja 1.13
    (the one requirements.txt installs there) and 1.11 (e.g. Debian's /usr/bin/ninja) hash build commands
    differently: each takes the other's build log for changed commands and recompiles every object. With
    processes that see different PATHs sharing one TORCH_EXTENSIONS_DIR (a sweep's cells, a launcher's
    ranks, the tests), every switch rebuilt async_io or CPU Adam, minutes each on a small machine."""
    bindir = os.path.dirname(sys.executable)
    parts = env.get("PATH", "").split(os.pathsep) if env.get("PATH") else []
    if parts[:1] != [bindir]:
        env["PATH"] = os.pathsep.join([bindir] + [p for p in parts if p != bindir])


def stale_locks(env, older_than_s: float = 600) -> list[str]:
    """Build locks left in the extensions cache for longer than ``older_than_s``. torch takes a lock file
    per op while it compiles and waits, without a word, for as long as that file exists: one left by a
    build that was killed makes every later build of that op hang."""
    root = env.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    now = time.time()
    found = []
    for path in sorted(glob.glob(os.path.join(root, "**", "lock"), recursive=True)):
        try:
            if now - os.path.getmtime(path) > older_than_s:
                found.append(path)
        except OSError:
            continue  # a build finished and removed it meanwhile
    return found


def prebuild(backends, env, timeout_s: float = 1800) -> list[str]:
    """Build the ops the backends need; returns one line per op (never raises: a cell reports its own
    failure if an op is still missing)."""
    names = sorted({op for b in backends for op in OPS.get(b, [])})
    if not names:
        return []
    warnings = [
        f"warning: build lock {path} is older than 10 minutes; if no build is running it was left by "
        "a killed one and the build of that op waits for it forever: delete it"
        for path in stale_locks(env)
    ]
    try:
        p = subprocess.run(
            [sys.executable, "-m", BUILD_MODULE, *names], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return warnings + [
            f"building DeepSpeed ops {', '.join(names)} took longer than {timeout_s:.0f} s; cells will build them"
        ]
    lines = [line for line in p.stdout.splitlines() if ": " in line and line.split(":")[0] in names]
    if p.returncode != 0 and not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        lines = [f"building DeepSpeed ops failed: {tail[0]}"]
    return warnings + lines
