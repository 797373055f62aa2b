"""This machine's rates, measured by short probes and cached; each one can be given by hand instead.

- NVMe read/write bandwidth of the swap directory: a short O_DIRECT write and read-back of a fresh file
  through our engine (``aidaptiv_ds.engine.io.IOEngine``, pinned pool), median of the repeats, with the block size
  and queue depth that a short sweep (:mod:`aidaptiv_ds.engine.tuning`) chose for the disk; cached per device
  (``st_dev`` and the disk's model) with the sweep, where the swapper finds its "auto" I/O settings.
- CPU matmul FLOP/s in the training dtype (all threads), and CPU Adam throughput (parameters per second
  of torch's foreach AdamW on fp32 CPU tensors: DeepSpeed's CPU Adam is faster, so this bounds it from
  below); cached per CPU model and thread count.
- Host memory the framework takes per rank: the peak RSS of a real 1-rank ``aidaptiv-ds train`` run of
  the micro preset under ZeRO-3, less what the plan counts for its model (state, buffers, activations).
- Host memory of the deepspeed launcher per node: its runner and launch.py are two Python processes that
  import deepspeed (and so torch) and then wait on the ranks; the peak RSS of a Python that imports
  deepspeed, twice.
- ZeRO-3's own work per step when training on CPU (gathering and releasing every parameter, partitioning the
  gradients), as parameters per second: a real 1-rank ZeRO-3 run of the tiny preset, its median step less
  the compute and Adam time the two CPU rates above predict for it; cached per CPU and Python.
- With CUDA: pinned host->GPU copy bandwidth and GPU matmul FLOP/s.

The cache is ``$XDG_CACHE_HOME/aidaptiv-ds/rates.json`` (``~/.cache`` by default; ``$AIDAPTIV_DS_CACHE_DIR``
replaces the folder). Every figure records how it was obtained ("measured <date>", "given"); figures that are
neither are left out, never guessed. For other hardware (``machine_rates(this_machine=False)``) nothing is
probed and no rate of this machine's disk, CPU or GPU is read: only the given ones, and the software's own
memory from the cache.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

from aidaptiv_ds.common.sizes import MiB
from aidaptiv_ds.engine.machine import kernel_cpu_model
from aidaptiv_ds.engine.machine_cache import (  # noqa: F401
    cache_path,
    disk_key,
    load_cache,
    save_cache,
)

RATE_NAMES = (
    "nvme_read",
    "nvme_write",
    "cpu_flops",
    "cpu_adam",
    "zero3_cpu",
    "framework_host",
    "launcher_host",
    "pcie",
    "gpu_flops",
)
UNITS = {
    "nvme_read": "B/s",
    "nvme_write": "B/s",
    "cpu_flops": "FLOP/s",
    "cpu_adam": "params/s",
    "zero3_cpu": "params/s",
    "framework_host": "B",
    "launcher_host": "B",
    "pcie": "B/s",
    "gpu_flops": "FLOP/s",
}
NVME_PROBE_BYTES = 256 * MiB
NVME_PROBE_REPEATS = 3


@dataclass
class Rates:
    nvme_read: Optional[float] = None  # bytes/s of one node's swap disk
    nvme_write: Optional[float] = None
    cpu_flops: Optional[float] = None  # FLOP/s of one node's CPUs (all threads) in the training dtype
    cpu_adam: Optional[float] = None  # parameters/s of one node's CPUs
    zero3_cpu: Optional[float] = None  # parameters/s of ZeRO-3's per-step work (gather, release, partition) on CPU
    framework_host: Optional[float] = None  # host bytes per rank before any model state
    launcher_host: Optional[float] = None  # host bytes per node of the deepspeed launcher's processes
    pcie: Optional[float] = None  # host->GPU bytes/s per GPU
    gpu_flops: Optional[float] = None  # FLOP/s per GPU
    source: Dict[str, str] = field(default_factory=dict)
    # The I/O settings the NVMe probe chose for the swap disk (aidaptiv_ds.engine.tuning): block_size,
    # queue_depth, when; empty when the disk was not probed (or was, before tuning existed).
    io: Dict[str, object] = field(default_factory=dict)

    def set(self, name: str, value: Optional[float], how: str) -> None:
        if value is not None:
            setattr(self, name, float(value))
            self.source[name] = how

    def as_dict(self) -> dict:
        return {
            n: {"value": getattr(self, n), "unit": UNITS[n], "source": self.source.get(n)}
            for n in RATE_NAMES
            if getattr(self, n) is not None
        }


# ------------------------------------------------------------------------------------------------ cache
# (aidaptiv_ds.engine.machine_cache: one file, shared with the swapper, which reads the I/O settings tuned per disk)


def cpu_key(dtype: str) -> str:
    """The cache key of this machine's CPUs in ``dtype``. Its form is the cache's (entries measured before stay
    found): the kernel's model name, else what Python's platform module says, and the thread count."""
    import platform

    cpu = kernel_cpu_model() or platform.processor() or platform.machine()
    return f"cpu:{cpu}:{os.cpu_count()}:{dtype}"


def _stamp() -> str:
    return "measured " + dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ------------------------------------------------------------------------------------------------ probes


def probe_nvme(
    directory: str, nbytes: int = NVME_PROBE_BYTES, repeats: int = NVME_PROBE_REPEATS, tune: bool = True
) -> Dict[str, object]:
    """Median O_DIRECT write and read bandwidth (bytes/s) of a fresh file in ``directory`` through our engine.
    With ``tune``, first the block size x queue depth sweep of :mod:`aidaptiv_ds.engine.tuning` (files of at most
    ``nbytes``): the bandwidths are then measured with its choice, which is returned with the whole table
    (``block_size``, ``queue_depth``, ``io_sweep``); without, with the engine's defaults.
    Raises ValueError for a memory filesystem or one that refuses O_DIRECT."""
    import torch

    from aidaptiv_ds.engine import tuning as io_tuning
    from aidaptiv_ds.engine.disk import UnsuitableDisk, check_dir
    from aidaptiv_ds.engine.io import IOEngine, PinnedPool

    try:
        check_dir(directory)
    except UnsuitableDisk as e:
        raise ValueError(f"`nvme_path` {e}") from None
    tuned: Dict[str, object] = {}
    if tune:
        table = io_tuning.sweep(directory, nbytes=min(nbytes, io_tuning.SWEEP_BYTES))
        block, depth = io_tuning.choose(table)
        tuned = {"block_size": block, "queue_depth": depth, "io_sweep": table}
    pool = PinnedPool(nbytes)
    buf = pool.allocate(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    engine = IOEngine(pool=pool, block_size=tuned.get("block_size"), queue_depth=tuned.get("queue_depth"))
    try:
        writes, reads = io_tuning.time_write_read(engine, buf, directory, ".aidaptiv-plan-probe", repeats)
    finally:
        engine.close()
    return {"nvme_write": statistics.median(writes), "nvme_read": statistics.median(reads), **tuned}


def probe_cpu(dtype: str = "bf16") -> Dict[str, float]:
    """CPU matmul FLOP/s in ``dtype`` (a 1024-square product, all threads) and foreach-AdamW parameters/s."""
    import torch

    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    n = 1024
    a, b = torch.randn(n, n).to(tdtype), torch.randn(n, n).to(tdtype)
    torch.matmul(a, b)
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < 0.5:
        torch.matmul(a, b)
        reps += 1
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)
    numel = 4 * 1024 * 1024
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    opt.step()
    steps, t0 = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - t0 < 0.5:
        opt.step()
        steps += 1
    adam = numel * steps / (time.perf_counter() - t0)
    return {"cpu_flops": flops, "cpu_adam": adam}


# The framework probe: a real 1-rank ZeRO-3 run of the micro preset (ds_configs/zero3.json's settings, fp32).
_PROBE_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
}
_PROBE_SEQ = 16


def _probe_train(what: str, model: str, seq_len: int, micro_batch: int, steps: int, warmup: int, timeout: int) -> dict:
    """The metrics of a real 1-rank ``aidaptiv-ds train`` run under ZeRO-3 in memory (:data:`_PROBE_CONFIG`,
    fp32) in a fresh temporary folder, with no rank variables inherited; RuntimeError naming ``what`` when it
    fails or writes no metrics."""
    import tempfile

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")
    }
    with tempfile.TemporaryDirectory(prefix="aidaptiv-plan-probe-") as tmp:
        cfg, metrics = os.path.join(tmp, "zero3.json"), os.path.join(tmp, "metrics.json")
        with open(cfg, "w") as f:
            json.dump(dict(_PROBE_CONFIG, train_micro_batch_size_per_gpu=micro_batch), f)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "aidaptiv_ds",
                "train",
                "--config",
                cfg,
                "--model",
                model,
                "--seq-len",
                str(seq_len),
                "--micro-batch",
                str(micro_batch),
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
                "--no-progress",
                "--metrics-out",
                metrics,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tmp,
        )
        try:
            with open(metrics) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = None
    if out.returncode != 0 or not isinstance(result, dict):
        raise RuntimeError(
            f"{what} (aidaptiv-ds train --model {model}) failed (exit {out.returncode}): "
            f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
    return result


def probe_framework() -> Dict[str, float]:
    """Host bytes per rank that are not model state: the peak RSS of a real 1-rank ``aidaptiv-ds train`` run
    of the micro preset under ZeRO-3 (torch, DeepSpeed, transformers, the process group, the data, DeepSpeed's
    ops), less what the plan counts for that run's model (its state, buffers and activations)."""
    from aidaptiv_ds.planner.memory import Hardware, Job, plan_backend
    from aidaptiv_ds.planner.shapes import resolve_shape

    peak = _probe_train("the framework memory probe", "micro", _PROBE_SEQ, 1, steps=2, warmup=1, timeout=600).get(
        "peak_rss_mb"
    )
    if not peak:
        raise RuntimeError("the framework memory probe (aidaptiv-ds train --model micro) wrote no peak_rss_mb")
    job = Job(resolve_shape("micro"), _PROBE_SEQ, 1, dtype="fp32")
    model = plan_backend("zero3", job, Hardware(gpus=1, host_mem=1 << 62)).host_bytes  # framework counted as 0
    return {"framework_host": float(max(0.0, peak * MiB - model))}


# The ZeRO-3 probe: a real 1-rank run of the tiny preset (ds_configs/zero3.json's settings, fp32), long enough
# for a median of the timed steps.
_ZERO3_PROBE = dict(model="tiny", seq_len=64, micro_batch=2, steps=6, warmup=2)


def probe_zero3(cpu_flops: float, cpu_adam: float) -> Dict[str, float]:
    """Parameters per second of ZeRO-3's own work in a training step on CPU: the median step of a real 1-rank
    ``aidaptiv-ds train`` run (tiny preset, ZeRO-3 in memory, fp32) less the forward/backward FLOPs at
    ``cpu_flops`` and the Adam update at ``cpu_adam``. What it stands for: every parameter is gathered and
    released twice a step and its gradient copied into its partition, work that grows with the parameters and
    not with the tokens (on the tiny preset the step takes about as long at 128 tokens as at 256)."""
    from aidaptiv_ds.planner.memory import Job, step_flops
    from aidaptiv_ds.planner.shapes import resolve_shape

    pr = _ZERO3_PROBE
    step = _probe_train(
        "the ZeRO-3 step probe",
        pr["model"],
        pr["seq_len"],
        pr["micro_batch"],
        steps=pr["steps"],
        warmup=pr["warmup"],
        timeout=900,
    ).get("step_s_median")
    if not step:
        raise RuntimeError(f"the ZeRO-3 step probe (aidaptiv-ds train --model {pr['model']}) wrote no step time")
    shape = resolve_shape(pr["model"])
    job = Job(shape, pr["seq_len"], pr["micro_batch"], dtype="fp32")
    rest = step - step_flops(job) / cpu_flops - shape.num_parameters / cpu_adam
    if rest <= 0:
        return {}  # the step is all compute and Adam here: nothing to add (the rate stays unknown, not 0)
    return {"zero3_cpu": shape.num_parameters / rest}


# The deepspeed launcher runs two Python processes per node besides the ranks: bin/deepspeed (the runner)
# and deepspeed.launcher.launch, each of which imports deepspeed.
LAUNCHER_PROCESSES = 2


def probe_launcher() -> Dict[str, float]:
    """Host bytes per node of the deepspeed launcher's own processes: the peak RSS of a Python that imports
    deepspeed (as the runner and launch.py do), times :data:`LAUNCHER_PROCESSES`.

    The peak is the child's VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across fork and exec, so
    a child of a big process (``aidaptiv-ds plan`` with torch loaded) reported its parent's size (1.5 GiB
    for two launcher processes where each holds about 250 MB)."""
    code = (
        "import deepspeed; print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines or not lines[-1].isdigit():
        raise RuntimeError(
            f"the launcher memory probe (python -c 'import deepspeed') failed (exit "
            f"{out.returncode}): {(out.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
    return {"launcher_host": float(LAUNCHER_PROCESSES * int(lines[-1]) * 1024)}


def probe_gpu(dtype: str = "bf16") -> Dict[str, float]:
    """Pinned host->GPU copy bandwidth and GPU matmul FLOP/s (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    nbytes = 256 * MiB
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    pcie = 5 * nbytes / (time.perf_counter() - t0)
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=tdtype)
    b = torch.randn(n, n, device="cuda", dtype=tdtype)
    torch.matmul(a, b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    flops = 10 * 2 * n**3 / (time.perf_counter() - t0)
    return {"pcie": pcie, "gpu_flops": flops}


def gpu_key() -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return None
    return f"gpu:{torch.cuda.get_device_name(0)}"


# ------------------------------------------------------------------------------------------------ assembly


def machine_rates(
    dtype: str,
    nvme_dir: Optional[str],
    probe: bool = True,
    reprobe: bool = False,
    want_gpu: bool = False,
    given: Optional[Dict[str, float]] = None,
    cache_file: Optional[str] = None,
    log=None,
    this_machine: bool = True,
) -> Rates:
    """Rates for planning: ``given`` ones as they are, the rest from the cache, or measured now (``probe``)
    and cached; ``reprobe`` measures again. A rate that is neither given, cached nor probed stays None.

    ``this_machine`` False: the plan is for other hardware, which this machine's disk, CPU and GPU say nothing
    about. Nothing is probed, and of the cache only the memory of the software itself (``framework_host``,
    ``launcher_host``: this installation's torch and DeepSpeed, the same wherever it runs) is read; every rate
    of the hardware is the given one or None."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    if not this_machine:
        probe = reprobe = want_gpu = False
    rates = Rates()
    for name, value in given.items():
        rates.set(name, value, "given")
    cache = load_cache(cache_file)
    changed = False

    def fill(key: str, names, prober):
        nonlocal changed
        names = [n for n in names if n not in given]
        if not names:
            return
        entry = cache.get(key) or {}
        fresh = False
        if probe and (reprobe or any(n not in entry for n in names)):
            if log:
                log(f"measuring {', '.join(names)} ({key}) ...")
            try:
                measured = prober()
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                # A probe that cannot run leaves its rates unknown (the plan says which); a bad directory
                # (ValueError) is the user's to fix and propagates.
                if log:
                    log(f"could not measure {', '.join(names)}: {e}")
                measured = {}
            if not measured:
                return
            entry = {**entry, **measured, "when": _stamp()}
            cache[key] = entry
            changed = fresh = True
        for n in names:
            if n in entry:
                rates.set(n, entry[n], entry.get("when", "measured") + ("" if fresh else ", cached"))

    if this_machine:
        _fill_hardware(fill, rates, cache, dtype, nvme_dir)
    fill(f"framework:train-micro:{sys.executable}", ("framework_host",), probe_framework)
    fill(f"launcher:deepspeed:{sys.executable}", ("launcher_host",), probe_launcher)
    if want_gpu:
        key = gpu_key()
        if key is not None:
            fill(f"{key}:{dtype}", ("pcie", "gpu_flops"), lambda: probe_gpu(dtype))
    if changed:
        try:
            save_cache(cache, cache_file)
        except OSError as e:  # a read-only home: the figures are still used, only not kept
            if log:
                log(f"could not write the rates cache {cache_file or cache_path()} ({e.strerror}): not cached")
    return rates


def _fill_hardware(fill, rates: Rates, cache: dict, dtype: str, nvme_dir: Optional[str]) -> None:
    """The rates of this machine's swap disk and CPUs, through ``fill`` (:func:`machine_rates`)."""
    if nvme_dir is not None:
        key = disk_key(nvme_dir)
        fill(key, ("nvme_read", "nvme_write"), lambda: probe_nvme(nvme_dir))
        entry = cache.get(key) or {}
        if "block_size" in entry and "queue_depth" in entry:
            rates.io = {
                "block_size": entry["block_size"],
                "queue_depth": entry["queue_depth"],
                "when": entry.get("when", "measured"),
            }
    fill(cpu_key(dtype), ("cpu_flops", "cpu_adam"), lambda: probe_cpu(dtype))

    def zero3_probe():
        # Against the fp32 CPU rates (the probe run trains in fp32): this plan's, or the cached ones, or new.
        fp32 = (
            {"cpu_flops": rates.cpu_flops, "cpu_adam": rates.cpu_adam}
            if dtype == "fp32"
            else (cache.get(cpu_key("fp32")) or probe_cpu("fp32"))
        )
        return (
            probe_zero3(fp32["cpu_flops"], fp32["cpu_adam"]) if fp32.get("cpu_flops") and fp32.get("cpu_adam") else {}
        )

    fill(f"zero3:train-tiny:{cpu_key('fp32')}:{sys.executable}", ("zero3_cpu",), zero3_probe)


def replace(rates: Rates, **values) -> Rates:
    """A copy with some rates set (given by hand)."""
    out = dataclasses.replace(rates, source=dict(rates.source))
    for k, v in values.items():
        out.set(k, v, "given")
    return out
