"""What a training run measured, and how it is written: one JSON object per run (``--metrics-out``).

Only measured numbers go in; what this process cannot measure is JSON null, never an estimate:
- ``peak_rss_mb``: this process's peak RSS since it started (VmHWM in /proc/self/status; ru_maxrss where
  that is missing), max over ranks (includes pinned buffers).
- ``nvme_read_bytes``/``nvme_write_bytes``: deltas of /proc/self/io read_bytes/write_bytes over the timed
  steps, summed over ranks. These count block-device I/O this process caused (O_DIRECT included, page-cache
  hits excluded; writes are counted when dirtied). Everything the process reads or writes on a block device
  counts, so they are the swap traffic plus anything else (e.g. checkpoints saved inside the window).
- ``disk_busy``: per swap device, the fraction of the timed steps' wall time it had requests in flight
  (io_ticks of /sys/class/block/<dev>/stat; evaluations and checkpoint saves inside the window are taken
  out; the whole device, so other processes' I/O counts too). Near 1
  the run is bound by the disk; well below it, by compute or by I/O issued too late.
- ``peak_pinned_mb``, ``phases_s.io_wait``: only from an engine that reports them (``aidaptiv_stats()``);
  such an engine also adds ``phases_s.optimizer_update`` (time applying optimizer updates per step, which
  for fp32 our swapper does inside the next forward) and ``swapper`` (its cumulative counters).
- ``peak_gpu_mb``: torch.cuda.max_memory_allocated when CUDA is used.
- ``traceback`` (runs with status "error" only): the last frames of the failure, whose one-line ``error``
  says what went wrong but not where.
- ``activations`` (aidaptiv only): the activation policy applied (``aidaptiv.activations``), how blocks are
  recomputed, the loss chunk, and for the nvme and auto policies the store's counters (tensors and bytes
  stored and read back, reads ahead, its file's size, ``io_wait_s``); for auto also ``plan``, each block's
  mode, why and measured figures, with the kept, stored and recomputed blocks and the budget
  (:func:`aidaptiv_ds.activations.plan.summary`); ``phases_s.activation_io_wait`` is the median per
  step of the time the backward waited for stored activations (not in ``phases_s.io_wait``, which is the
  parameters' and optimizer state's). ``loss_logits_mb`` (any run whose loss is
  chunked) is arithmetic from the shapes: the fp32 logits and their gradient that exist at once, unchunked
  and chunked.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import time


def _status_mib(field: str) -> float | None:
    """A memory line of /proc/self/status (``VmRSS``, ``VmHWM``) in MiB; None where /proc is unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def rss_mb() -> float | None:
    """This process's resident memory now (VmRSS), MiB."""
    return _status_mib("VmRSS")


def peak_rss_mb() -> float:
    """Peak RSS of this process, MiB. VmHWM belongs to the program (a new one at exec); getrusage's ru_maxrss
    survives fork and exec on Linux, so a run started by a bigger process (the planner's probe inside
    ``aidaptiv-ds plan``, a notebook) would report its parent's size."""
    hwm = _status_mib("VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def proc_io() -> dict | None:
    """{read_bytes, write_bytes} of this process from /proc/self/io, or None where it is unavailable."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}
    except (OSError, KeyError, ValueError):
        return None


def disk_busy_ticks(device: str | None) -> tuple[str, float, int] | None:
    """(device, monotonic seconds now, io_ticks ms) of a block device ("/dev/vda"): io_ticks (the 10th field of
    /sys/class/block/<dev>/stat) is the time the device had requests in flight, so its growth over a window is
    how busy the disk was there. None where sysfs does not say (no device, not Linux)."""
    if not device:
        return None
    try:
        with open(f"/sys/class/block/{os.path.basename(device)}/stat") as f:
            return device, time.monotonic(), int(f.read().split()[9])
    except (OSError, IndexError, ValueError):
        return None


def disk_busy(start: list, end: list, excluded: list = ()) -> list[dict] | None:
    """Per device, the fraction of the window between two :func:`disk_busy_ticks` readings of the same devices
    that the device had requests in flight (one entry per distinct device). ``excluded``: (start, end) reading
    pairs of spans inside the window that are not the steps (evaluations, checkpoint saves), whose time and
    busy time are taken out of both."""
    out, seen = [], set()
    for i, (a, b) in enumerate(zip(start, end)):
        if not a or not b or a[0] != b[0] or a[0] in seen:
            continue
        seconds, busy_ms = b[1] - a[1], b[2] - a[2]
        for before, after in excluded:
            x, y = before[i] if i < len(before) else None, after[i] if i < len(after) else None
            if x and y and x[0] == a[0]:
                seconds -= y[1] - x[1]
                busy_ms -= y[2] - x[2]
        if seconds <= 0:
            continue
        seen.add(a[0])
        out.append({"device": a[0], "fraction": round(max(0.0, min(1.0, busy_ms / 1000 / seconds)), 4)})
    return out or None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class IOMeter:
    """The block-device bytes this process read and wrote and how busy the swap devices were, over the timed
    steps: from :meth:`start` (after the warm-up steps) to :meth:`stop`, less what :meth:`outside_steps`
    spans inside that window did (held-out evaluations, checkpoint saves)."""

    def __init__(self, devices: list):
        self.devices = devices
        self.io_start = self.io_end = None
        self.excluded = {"read_bytes": 0, "write_bytes": 0}
        self.busy_start, self.busy_end, self.busy_excluded = [], [], []

    def _busy(self) -> list:
        return [disk_busy_ticks(d) for d in self.devices]

    def start(self) -> None:
        self.io_start, self.busy_start = proc_io(), self._busy()

    def outside_steps(self, action) -> None:
        """Run ``action``; its disk bytes and busy time, inside the window, are not the steps'."""
        before, busy_before = proc_io(), self._busy()
        action()
        after = proc_io()
        if before and after and self.io_start:
            for k in self.excluded:
                self.excluded[k] += after[k] - before[k]
            self.busy_excluded.append((busy_before, self._busy()))

    def stop(self) -> None:
        self.io_end = proc_io()
        if self.busy_start:
            self.busy_end = self._busy()

    @property
    def started(self) -> bool:
        return self.io_start is not None

    def bytes(self) -> list:
        """[read, write] bytes of the timed steps (None each where /proc/self/io could not say)."""
        if not (self.io_start and self.io_end):
            return [None, None]
        return [self.io_end[k] - self.io_start[k] - self.excluded[k] for k in ("read_bytes", "write_bytes")]

    def busy(self) -> list | None:
        """:func:`disk_busy` of the window (None before :meth:`start`)."""
        if not self.busy_start:
            return None
        return disk_busy(self.busy_start, self.busy_end, self.busy_excluded)


class StepTimer:
    """Wall time of named phases within optimizer steps; ``sync`` (cuda.synchronize) runs before each reading
    so asynchronous GPU work is charged to the phase that queued it."""

    PHASES = ("forward", "backward", "optimizer")

    def __init__(self, sync=None):
        self._sync = sync or (lambda: None)
        self.steps: list[dict] = []  # per optimizer step: {"step_s", "forward", "backward", "optimizer"}
        self._current = None
        self._t0 = None

    def now(self) -> float:
        self._sync()
        return time.perf_counter()

    def start_step(self):
        self._current = {p: 0.0 for p in self.PHASES}
        self._t0 = self.now()

    def add(self, phase: str, seconds: float):
        self._current[phase] += seconds

    def end_step(self) -> float:
        self._current["step_s"] = self.now() - self._t0
        self.steps.append(self._current)
        return self._current["step_s"]


def summarize(
    *,
    step_records: list[dict],
    warmup: int,
    tokens_per_step: int,
    losses: list[float],
    engine_stats: dict | None,
    peak_rss: float,
    peak_gpu: float | None,
    nvme_read: int | None,
    nvme_write: int | None,
    extra: dict,
) -> dict:
    """The metrics object. Medians are over the steps after ``warmup`` (all steps if there are no others)."""
    timed = step_records[warmup:] if len(step_records) > warmup else step_records
    step_med = median([r["step_s"] for r in timed])
    io_wait = None
    peak_pinned = None
    update = update_deferred = None
    if engine_stats:
        applied = engine_stats.get("optimizer_apply_s_steps")
        if applied:
            update = median(list(applied)[warmup:] if len(applied) > warmup else list(applied))
        deferred = engine_stats.get("optimizer_apply_deferred_s_steps")
        if deferred:
            update_deferred = median(list(deferred)[warmup:] if len(deferred) > warmup else list(deferred))
        waits = engine_stats.get("io_wait_s")
        if isinstance(waits, (list, tuple)):
            io_wait = median(list(waits)[warmup:] if len(waits) > warmup else list(waits))
        elif isinstance(waits, (int, float)):
            io_wait = float(waits)
        if engine_stats.get("peak_pinned_bytes") is not None:
            peak_pinned = engine_stats["peak_pinned_bytes"] / 2**20
    out = {
        "status": "ok",
        **extra,
        "tokens_per_s": (tokens_per_step / step_med) if step_med else None,
        "step_s_median": step_med,
        "step_s": [r["step_s"] for r in step_records],
        "losses": losses,
        "peak_rss_mb": peak_rss,
        "peak_pinned_mb": peak_pinned,
        "peak_gpu_mb": peak_gpu,
        "nvme_read_bytes": nvme_read,
        "nvme_write_bytes": nvme_write,
        "phases_s": {
            "forward": median([r["forward"] for r in timed]),
            "backward": median([r["backward"] for r in timed]),
            "optimizer": median([r["optimizer"] for r in timed]),
            "io_wait": io_wait,
        },
    }
    if update is not None:
        # Our swapper applies an fp32 step's updates inside the next forward: this is that share of the
        # forward (and all of what engine.step() itself took is in "optimizer").
        out["phases_s"]["optimizer_update"] = update
    if update_deferred is not None:
        # The part of it applied outside engine.step(): in the forward (hidden behind its I/O, or not).
        out["phases_s"]["optimizer_update_deferred"] = update_deferred
    activations = (engine_stats or {}).get("activations")
    if activations:
        out["activations"] = activations
        wait = _activation_wait_per_step(activations.get("io_wait_s_cycles"), extra.get("grad_accum") or 1, warmup)
        if wait is not None:
            out["phases_s"]["activation_io_wait"] = wait
    if engine_stats:
        out["swapper"] = {
            k: v for k, v in engine_stats.items() if not isinstance(v, (list, tuple)) and k != "activations"
        }
    return out


def _activation_wait_per_step(cycle_waits, grad_accum: int, warmup: int):
    """Median over the timed steps of the backward's wait for stored activations (one cycle per micro-step)."""
    if not cycle_waits:
        return None
    steps = [sum(cycle_waits[i : i + grad_accum]) for i in range(0, len(cycle_waits) - grad_accum + 1, grad_accum)]
    return median(steps[warmup:] if len(steps) > warmup else steps)


def one_line(m: dict) -> str:
    """The run in one line, for logs."""

    def f(v, fmt):
        return "null" if v is None else format(v, fmt)

    if m.get("status") != "ok":
        return f"aidaptiv-ds train: status={m.get('status')} error={m.get('error')}"
    losses = m.get("losses") or []
    ph = m.get("phases_s") or {}
    return (
        f"aidaptiv-ds train: status=ok model={m.get('model')} backend={m.get('backend')} "
        f"world={m.get('world_size')} mb={m.get('micro_batch')}x{m.get('seq_len')} ga={m.get('grad_accum')} "
        f"steps={m.get('steps')} tokens/s={f(m.get('tokens_per_s'), '.1f')} "
        f"step_s_median={f(m.get('step_s_median'), '.3f')} "
        f"fwd/bwd/opt={f(ph.get('forward'), '.3f')}/{f(ph.get('backward'), '.3f')}/{f(ph.get('optimizer'), '.3f')} "
        f"loss={f(losses[0] if losses else None, '.4f')}->{f(losses[-1] if losses else None, '.4f')} "
        f"peak_rss_mb={f(m.get('peak_rss_mb'), '.0f')} nvme_r/w_mb="
        f"{f(None if m.get('nvme_read_bytes') is None else m['nvme_read_bytes'] / 2**20, '.1f')}/"
        f"{f(None if m.get('nvme_write_bytes') is None else m['nvme_write_bytes'] / 2**20, '.1f')}"
        + "".join(f" disk_busy={os.path.basename(d['device'])}:{d['fraction']:.0%}" for d in m.get("disk_busy") or [])
    )


def write_json(path: str, metrics: dict, exclusive: bool = False) -> bool:
    """Write atomically (temp file + rename); non-finite floats (a diverged loss) become null so the file stays
    strict JSON. With ``exclusive``, do nothing if the file already exists."""
    if exclusive and os.path.exists(path):
        return False
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_finite_or_null(metrics), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return True


def _finite_or_null(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_null(v) for v in obj]
    return obj


# Per-step series written to DeepSpeed's monitor (the config's "tensorboard", "csv_monitor" and "wandb"
# sections), one event per name and optimizer step; the CSV monitor names its files after them with "/"
# turned into "_" (aidaptiv_loss.csv, ...). NVMe GB/s is this rank's block-device I/O (rank 0's: the monitor
# writes on rank 0 only) over the step's wall time, checkpoint saves left out.
MONITOR_SERIES = (
    "loss",
    "lr",
    "tokens_per_s",
    "step_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "nvme_read_GBps",
    "nvme_write_GBps",
    "host_budget_bytes",
    "pinned_bytes",
    "host_rss_mb",
    "gpu_mem_mb",
)
MONITOR_PREFIX = "aidaptiv/"


def monitor_events(
    step: int,
    record: dict,
    *,
    loss: float,
    lr: float | None,
    tokens_per_step: int,
    io_bytes: tuple | None,
    host_budget: int | None,
    pinned: int | None,
    gpu_mb: float | None,
    rss_mb: float | None = None,
) -> list:
    """[(name, value, step)] of one optimizer step, as DeepSpeed's MonitorMaster.write_events takes them;
    what this run cannot measure (no swapper: no budget or pinned bytes; no CUDA: no GPU memory; no
    /proc/self/io: no NVMe rates) is left out rather than written as 0."""
    s = record["step_s"]
    values = {
        "loss": loss,
        "lr": lr,
        "tokens_per_s": tokens_per_step / s if s > 0 else None,
        "step_s": s,
        "forward_s": record["forward"],
        "backward_s": record["backward"],
        "optimizer_s": record["optimizer"],
        "nvme_read_GBps": io_bytes[0] / s / 1e9 if io_bytes and s > 0 else None,
        "nvme_write_GBps": io_bytes[1] / s / 1e9 if io_bytes and s > 0 else None,
        "host_budget_bytes": host_budget,
        "pinned_bytes": pinned,
        "host_rss_mb": rss_mb,
        "gpu_mem_mb": gpu_mb,
    }
    return [(MONITOR_PREFIX + k, float(values[k]), step) for k in MONITOR_SERIES if values[k] is not None]


# The held-out loss (train --eval-fraction/--eval-data), written at the steps it is computed (--eval-every and
# the last), beside the per-step series: aidaptiv/eval_loss (aidaptiv_eval_loss.csv in the CSV monitor).
EVAL_SERIES = ("eval_loss",)


def eval_events(step: int, eval_loss: float) -> list:
    """[(name, value, step)] of one evaluation, as DeepSpeed's MonitorMaster.write_events takes them."""
    return [(MONITOR_PREFIX + "eval_loss", float(eval_loss), step)]
