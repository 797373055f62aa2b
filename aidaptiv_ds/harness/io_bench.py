"""Measure O_DIRECT write and read bandwidth, and CPU time per GB, of the I/O engines on one disk, in one run.

For each repeat and each engine in turn (round robin, the order reversed every other repeat so that no engine
always runs first or last on a disk whose state depends on what ran before: uring, posix, deepspeed, fio, then
fio, deepspeed, posix, uring, ...), writes
``size`` bytes to a fresh file with O_DIRECT, reads it back with O_DIRECT (the page cache never answers),
checks that the bytes read are the bytes written, and removes the file. Reports per engine the median
GB/s (1 GB = 1e9 bytes) and CPU seconds per GB (process user + system time over the transfer, all threads).

Engines: uring and posix are ours (aidaptiv_ds.engine.io, io_uring with the pinned pool registered, and the POSIX
thread pool); deepspeed is DeepSpeed's libaio aio_handle at its best settings (overlap_events, no
single_submit, intra_op_parallelism 1, its own page-locked buffer); fio is fio's io_uring engine (when fio
is on PATH) with the same block size, queue depth and O_DIRECT, registered buffers like ours, and its
default preallocation of the file (ours preallocates writes that extend a file too; DeepSpeed does not);
fio checks only its byte counts, and reports the CPU time of its own thread only (not of the kernel's
io-wq workers, which ours counts). The disk here may be shared and noisy: compare engines
within one run, never a lone number across runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

from aidaptiv_ds.engine import machine
from aidaptiv_ds.engine.disk import block_device
from aidaptiv_ds.harness.machine import cpu_line

ENGINES = ("uring", "posix", "deepspeed", "fio")


ALIASES = {"io_uring": "uring", "iouring": "uring", "ds": "deepspeed", "libaio": "deepspeed"}


def default_engines() -> List[str]:
    return [e for e in ENGINES if e != "fio" or shutil.which("fio")]


def machine_info(path: str, mount: Dict[str, str]) -> dict:
    """The row's machine block: the CPU, RAM, kernel, and the disk under ``path`` (``mount`` is what
    :func:`aidaptiv_ds.engine.disk.check_dir` returned for it)."""
    info = {
        "cpu": machine.cpu_model() or platform.processor() or "unknown",
        "cpu_flags": machine.cpu_flags(),
        "cores": os.cpu_count(),
        "ram_gib": round(machine.physical_ram_bytes() / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "dir": os.path.realpath(path),
        "filesystem": mount["fstype"],
        "mount": mount["mountpoint"],
        "source": mount["source"],
    }
    info.update(block_device(path))
    return info


def git_sha() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# -- engines ----------------------------------------------------------------------------------------
def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


class Sample:
    def __init__(self, nbytes: int, seconds: float, cpu: float):
        self.gbps = nbytes / seconds / 1e9
        self.cpu_s_per_gb = cpu / (nbytes / 1e9)


def _timed(nbytes: int, fn) -> Sample:
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    t1, c1 = time.perf_counter(), cpu_seconds()
    return Sample(nbytes, t1 - t0, c1 - c0)


class OurEngine:
    """aidaptiv_ds.engine.io with its best settings: pool-registered buffers (io_uring fixed buffers)."""

    def __init__(self, backend: str, shared: dict, block: int, queue_depth: int):
        from aidaptiv_ds.engine.io import IOEngine, PinnedPool

        if "pool" not in shared:  # one pool for both of our engines
            shared["pool"] = PinnedPool(shared["reference"].numel())
            shared["pool_buffer"] = shared["pool"].allocate(shared["reference"].numel())
        self.buffer, self.reference = shared["pool_buffer"], shared["reference"]
        self.engine = IOEngine(backend=backend, block_size=block, queue_depth=queue_depth, pool=shared["pool"])
        if self.engine.backend.value != backend:
            raise RuntimeError(f"{backend} backend did not start: {self.engine.fallback_reason}")

    def write(self, path: str) -> Sample:
        self.buffer.copy_(self.reference)
        return _timed(self.buffer.numel(), lambda: self.engine.write(self.buffer, path))

    def read(self, path: str):
        import torch

        self.buffer.zero_()
        sample = _timed(self.buffer.numel(), lambda: self.engine.read(self.buffer, path))
        return sample, bool(torch.equal(self.buffer, self.reference))

    def close(self) -> None:
        self.engine.close()


class DeepSpeedEngine:
    """DeepSpeed's libaio aio_handle at its best settings, with a buffer it page-locked itself."""

    def __init__(self, shared: dict, block: int, queue_depth: int):
        import torch

        # The baseline, straight from DeepSpeed: its op builder compiles async_io just in time if
        # TORCH_EXTENSIONS_DIR has no build of it, and raises what the build raises.
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self.handle = AsyncIOBuilder().load(verbose=False).aio_handle(block, queue_depth, False, True, 1)
        self.reference = shared["reference"]
        self.buffer = self.handle.new_cpu_locked_tensor(self.reference.numel(), torch.empty(0, dtype=torch.uint8))

    def write(self, path: str) -> Sample:
        self.buffer.copy_(self.reference)
        return _timed(self.buffer.numel(), lambda: self._check(self.handle.sync_pwrite(self.buffer, path, 0)))

    def read(self, path: str):
        import torch

        self.buffer.zero_()
        sample = _timed(self.buffer.numel(), lambda: self._check(self.handle.sync_pread(self.buffer, path, 0)))
        return sample, bool(torch.equal(self.buffer, self.reference))

    @staticmethod
    def _check(count: int) -> None:
        if count != 1:
            raise RuntimeError(f"DeepSpeed's aio_handle returned {count} (expected 1 completed op)")

    def close(self) -> None:
        self.handle.free_cpu_locked_tensor(self.buffer)
        self.buffer = None


def fio_command(path: str, rw: str, nbytes: int, block: int, queue_depth: int) -> List[str]:
    return [
        "fio",
        "--output-format=json",
        f"--name=io-bench-{rw}",
        f"--filename={path}",
        f"--rw={rw}",
        f"--bs={block}",
        f"--size={nbytes}",
        "--ioengine=io_uring",
        f"--iodepth={queue_depth}",
        "--direct=1",
        "--fixedbufs=1",
        "--numjobs=1",
        "--unlink=0",
    ]


def parse_fio(text: str, rw: str) -> Sample:
    """fio's JSON output -> Sample (bandwidth from bytes and runtime; CPU from usr + sys percent of runtime)."""
    start = text.find("{")  # fio may print notes before the JSON
    if start < 0:
        raise RuntimeError(f"fio printed no JSON: {text.strip()[:200]}")
    job = json.loads(text[start:])["jobs"][0]
    side = job["read" if rw == "read" else "write"]
    if job.get("error"):
        raise RuntimeError(f"fio reported error {job['error']}")
    seconds = side["runtime"] / 1000.0
    if side["io_bytes"] <= 0 or seconds <= 0:
        raise RuntimeError(f"fio moved {side['io_bytes']} bytes in {seconds} s")
    run_seconds = job.get("job_runtime", side["runtime"]) / 1000.0
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * run_seconds
    return Sample(side["io_bytes"], seconds, cpu)


class FioEngine:
    def __init__(self, shared: dict, block: int, queue_depth: int):
        if not shutil.which("fio"):
            raise RuntimeError("fio is not on PATH: install fio (apt-get install fio)")
        self.nbytes, self.block, self.queue_depth = shared["reference"].numel(), block, queue_depth
        self.command = " ".join(fio_command("FILE", "write", self.nbytes, block, queue_depth))

    def _run(self, path: str, rw: str) -> Sample:
        result = subprocess.run(
            fio_command(path, rw, self.nbytes, self.block, self.queue_depth),
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if result.returncode != 0:
            raise RuntimeError(f"fio {rw} failed ({result.returncode}): {result.stderr.strip()[:300]}")
        return parse_fio(result.stdout, rw)

    def write(self, path: str) -> Sample:
        return self._run(path, "write")

    def read(self, path: str):
        return self._run(path, "read"), None  # fio checks byte counts only

    def close(self) -> None:
        pass


def make_engine(name: str, shared: dict, block: int, queue_depth: int):
    if name == "uring":
        return OurEngine("io_uring", shared, block, queue_depth)
    if name == "posix":
        return OurEngine("posix", shared, block, queue_depth)
    if name == "deepspeed":
        return DeepSpeedEngine(shared, block, queue_depth)
    return FioEngine(shared, block, queue_depth)


# -- results ----------------------------------------------------------------------------------------
def summarize(samples: Dict[str, list], verified: List[Optional[bool]], error: Optional[str] = None) -> dict:
    """Medians of the repeats; samples are lists of Sample per direction."""
    entry: dict = {}
    if samples["read"] and samples["write"]:
        entry.update(
            {
                "read_gbps": round(statistics.median(s.gbps for s in samples["read"]), 3),
                "write_gbps": round(statistics.median(s.gbps for s in samples["write"]), 3),
                "cpu_s_per_gb_read": round(statistics.median(s.cpu_s_per_gb for s in samples["read"]), 4),
                "cpu_s_per_gb_write": round(statistics.median(s.cpu_s_per_gb for s in samples["write"]), 4),
                "verified": None if any(v is None for v in verified) else all(verified),
                "repeats": len(samples["read"]),
                "samples": {
                    "read_gbps": [round(s.gbps, 3) for s in samples["read"]],
                    "write_gbps": [round(s.gbps, 3) for s in samples["write"]],
                },
            }
        )
    if error:
        entry["error"] = error
    return entry


def comparisons(engines: dict) -> List[str]:
    """One line per comparison the project's target names (uring vs fio, uring vs deepspeed)."""
    lines = []
    uring = engines.get("uring", {})
    if "read_gbps" not in uring:
        return lines
    for other in ("fio", "deepspeed"):
        theirs = engines.get(other, {})
        if "read_gbps" not in theirs:
            continue
        line = (
            f"uring / {other}: read {uring['read_gbps'] / theirs['read_gbps']:.2f}x, "
            f"write {uring['write_gbps'] / theirs['write_gbps']:.2f}x"
        )
        if theirs.get("cpu_s_per_gb_read"):
            line += (
                f"; CPU per GB read {uring['cpu_s_per_gb_read'] / theirs['cpu_s_per_gb_read']:.2f}x, "
                f"write {uring['cpu_s_per_gb_write'] / max(theirs['cpu_s_per_gb_write'], 1e-9):.2f}x"
            )
        lines.append(line)
    return lines


def format_table(result: dict) -> str:
    m, c = result["machine"], result["config"]
    rotational = {True: "rotational", False: "non-rotational", None: "rotational unknown"}[m.get("rotational")]
    lines = [
        f"machine: {cpu_line(m)}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; disk: "
        f"{m.get('device') or m['source']} ({m['filesystem']}, {rotational}) at {m['dir']}",
        f"config: {c['size_mb']} MiB per engine, block {c['block_kb']} KiB, queue depth {c['queue_depth']}, "
        f"{c['repeat']} repeats interleaved, O_DIRECT, fresh file per write; medians (GB = 1e9 bytes)",
        f"{'engine':<10} {'read GB/s':>10} {'write GB/s':>11} {'CPU s/GB rd':>12} {'CPU s/GB wr':>12}  verified",
    ]
    for name, e in result["engines"].items():
        if "read_gbps" in e:
            verified = {True: "yes", False: "NO", None: "n/a"}[e["verified"]]
            lines.append(
                f"{name:<10} {e['read_gbps']:>10.2f} {e['write_gbps']:>11.2f} "
                f"{e['cpu_s_per_gb_read']:>12.3f} {e['cpu_s_per_gb_write']:>12.3f}  {verified}"
            )
        if "error" in e:
            lines.append(f"{name:<10} error: {e['error']}")
    lines += comparisons(result["engines"])
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def stdout_to_stderr():
    """Send everything written to stdout meanwhile to stderr, at the descriptor level: DeepSpeed's logger
    holds its own reference to stdout, and --json must print exactly one object there."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def progress(message: str) -> None:
    print(f"io-bench: {message}", file=sys.stderr, flush=True)


def measure(engines: List[str], directory: str, size: int, block: int, queue_depth: int, repeat: int) -> dict:
    import torch

    progress(f"preparing {size >> 20} MiB of random bytes")
    reference = torch.empty(size // 8 + 1, dtype=torch.int64).random_(generator=torch.Generator().manual_seed(0))
    shared = {"reference": reference.view(torch.uint8)[:size]}
    live, errors = {}, {}
    samples = {e: {"read": [], "write": []} for e in engines}
    verified: Dict[str, list] = {e: [] for e in engines}
    positions: Dict[str, list] = {e: [] for e in engines}  # where each sample's engine ran in its repeat (0: first)
    for name in engines:
        try:
            live[name] = make_engine(name, shared, block, queue_depth)
        except Exception as e:  # an engine that cannot start is reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}"
            progress(f"{name} cannot run: {errors[name]}")
    try:
        for r in range(repeat):
            order = engines if r % 2 == 0 else engines[::-1]
            for name in order:
                if name not in live:
                    continue
                path = os.path.join(directory, f"io-bench-{name}-{r}-{os.getpid()}.bin")
                try:
                    w = live[name].write(path)
                    rd, ok = live[name].read(path)
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"
                    progress(f"{name} failed: {errors[name]}")
                    live.pop(name).close()
                    continue
                finally:
                    if os.path.exists(path):
                        os.unlink(path)
                samples[name]["write"].append(w)
                samples[name]["read"].append(rd)
                verified[name].append(ok)
                positions[name].append(order.index(name))
                progress(
                    f"[{r + 1}/{repeat}] {name:<9} write {w.gbps:6.2f} GB/s ({w.cpu_s_per_gb:.3f} CPU s/GB), "
                    f"read {rd.gbps:6.2f} GB/s ({rd.cpu_s_per_gb:.3f} CPU s/GB)"
                    + ("" if ok is not False else "  BYTES DIFFER")
                )
    finally:
        for engine in live.values():
            engine.close()
    out = {name: summarize(samples[name], verified[name], errors.get(name)) for name in engines}
    for name in engines:
        out[name]["positions"] = positions[name]
    return out
