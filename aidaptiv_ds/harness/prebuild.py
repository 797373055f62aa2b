"""Build DeepSpeed's just-in-time ops once, before the first cell.

DeepSpeed compiles some of its ops (CPU Adam, async_io, FusedAdam, the shared-memory communicator) the
first time a process needs them and caches them in TORCH_EXTENSIONS_DIR. Inside a cell that would count
against the cell's timeout, and under a host memory cap the compilers themselves are killed (a C++
compile takes about a GiB per job): a ZeRO-Infinity cell would be recorded as out of memory because of
its build. So the sweep builds what its backends need first, in a separate process with no cap.
"""
from __future__ import annotations

import subprocess
import sys

# DeepSpeed op builders each backend's cells load (CPU or CUDA builders alike, by name).
OPS = {
    "zero3": ["FusedAdamBuilder", "ShareMemCommBuilder"],
    "zero3_cpu_offload": ["CPUAdamBuilder", "ShareMemCommBuilder"],
    "zero_infinity": ["CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder"],
    "aidaptiv": ["CPUAdamBuilder", "ShareMemCommBuilder"],
}

_SCRIPT = """
import sys
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    builder = get_accelerator().get_op_builder(name)
    if builder is None:
        print(f"{name}: not used by this accelerator")
        continue
    if not builder().is_compatible():
        print(f"{name}: not compatible here (the cells that need it will say why)")
        continue
    try:
        builder().load(verbose=False)
        print(f"{name}: ready")
    except Exception as e:
        print(f"{name}: build failed: {str(e).splitlines()[-1] if str(e) else type(e).__name__}")
"""


def prebuild(backends, env, timeout_s: float = 1800) -> list[str]:
    """Build the ops the backends need; returns one line per op (never raises: a cell reports its own
    failure if an op is still missing)."""
    names = sorted({op for b in backends for op in OPS.get(b, [])})
    if not names:
        return []
    try:
        p = subprocess.run([sys.executable, "-c", _SCRIPT, *names], env=env, capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [f"building DeepSpeed ops {', '.join(names)} took longer than {timeout_s:.0f} s; cells will build them"]
    lines = [line for line in p.stdout.splitlines() if ": " in line and line.split(":")[0] in names]
    if p.returncode != 0 and not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        lines = [f"building DeepSpeed ops failed: {tail[0]}"]
    return lines
