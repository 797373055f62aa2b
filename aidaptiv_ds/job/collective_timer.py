"""How long a rank waits on its collectives in each training step (``train --time-collectives``): the cost of the
network between ranks, apart from the compute and the disk.

ZeRO-3 gathers every layer's parameters and scatters its gradients with asynchronous collectives: the call returns
at once and the rank waits later, on the handle. DeepSpeed's own comms logger times the call only (on CPU its
"synchronize" waits for nothing), so it sees none of that wait. This timer wraps torch.distributed's collectives and
counts, per kind, the time spent in the call and in the returned handle's ``wait()``: what the step spent blocked
on the other ranks and the wire, not the transfer time hidden behind compute.

It must be installed before ``deepspeed.init_distributed``: DeepSpeed's torch backend keeps references to these
functions from then on.
"""

from __future__ import annotations

import time
from collections import defaultdict

# The collectives ZeRO-3 steps use, by torch.distributed's names (as the metrics say them).
KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather", "reduce_scatter", "broadcast")


class _TimedWork:
    """An asynchronous collective's handle whose ``wait()`` is timed; everything else is the handle's."""

    def __init__(self, work, timer: "CollectiveTimer", kind: str):
        self._work, self._timer, self._kind = work, timer, kind

    def wait(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer.seconds[self._kind] += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._work, name)


class CollectiveTimer:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._originals: dict = {}
        self._step_start: tuple | None = None
        self.steps: list[dict] = []  # per step: {kind: [seconds, calls]}

    def install(self) -> None:
        import torch.distributed as dist

        for kind in KINDS:
            fn = getattr(dist, kind, None)
            if fn is not None and kind not in self._originals:
                self._originals[kind] = fn
                setattr(dist, kind, self._timed(kind, fn))

    def uninstall(self) -> None:
        import torch.distributed as dist

        for kind, fn in self._originals.items():
            setattr(dist, kind, fn)
        self._originals.clear()

    def _timed(self, kind, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                work = fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - t
                self.calls[kind] += 1
            return _TimedWork(work, self, kind) if work is not None else None

        timed.__wrapped__ = fn
        return timed

    def start_step(self) -> None:
        self._step_start = (dict(self.seconds), dict(self.calls))

    def end_step(self) -> None:
        seconds, calls = self._step_start or ({}, {})
        self.steps.append(
            {
                k: [self.seconds[k] - seconds.get(k, 0.0), self.calls[k] - calls.get(k, 0)]
                for k in self.calls
                if self.calls[k] - calls.get(k, 0)
            }
        )

    def summary(self, warmup: int) -> dict:
        """{kind: {"s_per_step": median seconds, "calls_per_step": median calls}} over the steps after
        ``warmup`` (all of them when there are no others)."""
        from statistics import median

        timed = self.steps[warmup:] if len(self.steps) > warmup else self.steps
        kinds = sorted({k for s in timed for k in s})
        return {
            k: {
                "s_per_step": median(s.get(k, [0.0, 0])[0] for s in timed),
                "calls_per_step": median(s.get(k, [0.0, 0])[1] for s in timed),
            }
            for k in kinds
        }
