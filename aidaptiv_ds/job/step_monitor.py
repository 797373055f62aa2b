"""Each step's series into DeepSpeed's monitors (TensorBoard, CSV, W&B) when the config enables one:
loss, lr, tokens/s, the step's split, NVMe bytes, host budget, pinned, GPU and host memory
(aidaptiv_ds.common.metrics.MONITOR_SERIES), and the held-out loss when it is computed."""

from __future__ import annotations

import contextlib
from typing import Optional


class StepMonitor:
    """The config's monitors for one run's engine, on rank 0 (DeepSpeed's MonitorMaster writes there only, so
    the other ranks skip the readings). ``enabled`` is False without a monitor section."""

    def __init__(self, engine, rank: int, host_budget: Optional[int], cuda: bool):
        m = getattr(engine, "monitor", None)
        self.master = m if m is not None and getattr(m, "enabled", False) and rank == 0 else None
        self.engine, self.host_budget, self.cuda = engine, host_budget, cuda

    @property
    def enabled(self) -> bool:
        return self.master is not None

    def write_step(self, step: int, record: dict, loss: float, tokens_per_step: int, io_before) -> None:
        """Step ``step``'s series; ``io_before``: /proc/self/io read when the step began (its bytes are the
        difference)."""
        import torch

        from aidaptiv_ds.common import metrics as M
        from aidaptiv_ds.zero3 import monitors

        io_after = M.proc_io()
        io = None
        if io_before and io_after:
            io = (io_after["read_bytes"] - io_before["read_bytes"], io_after["write_bytes"] - io_before["write_bytes"])
        lr = None
        with contextlib.suppress(Exception):
            lr = float(self.engine.get_lr()[0])
        stats = self.engine.aidaptiv_stats() if callable(getattr(self.engine, "aidaptiv_stats", None)) else None
        events = M.monitor_events(
            step,
            record,
            loss=loss,
            lr=lr,
            tokens_per_step=tokens_per_step,
            io_bytes=io,
            host_budget=self.host_budget,
            pinned=stats.get("pinned_bytes") if stats else None,
            gpu_mb=torch.cuda.memory_allocated() / 2**20 if self.cuda else None,
            rss_mb=M.rss_mb(),
        )
        monitors.write_events(self.master, events, self.engine)

    def write_eval(self, step: int, loss: float) -> None:
        from aidaptiv_ds.common import metrics as M
        from aidaptiv_ds.zero3 import monitors

        monitors.write_events(self.master, M.eval_events(step, loss), self.engine)
