"""Our per-step series (aidaptiv_ds.common.metrics.monitor_events) into DeepSpeed's monitors (its MonitorMaster).

TensorBoard, CSV and Comet keep a step per event, so they get our events as they are: step = optimizer step.
W&B keeps one step counter per run that may only grow, and DeepSpeed 0.19.8's engine already logs its own
events there (``Train/Samples/lr`` after every optimizer step) at step = ``engine.global_samples``, the
samples seen so far; ours at the optimizer step would be behind it and W&B would drop every one of them
("Steps must be monotonically increasing"). So W&B gets ours in one row at DeepSpeed's step, with the
optimizer step as their own x-axis (``aidaptiv/step``, declared with ``wandb.define_metric``).
"""

from __future__ import annotations

from aidaptiv_ds.common.metrics import MONITOR_PREFIX
from aidaptiv_ds.zero3.compat import (
    ENGINE_SAMPLES,
    MONITOR_WANDB,
    MONITORS_WITH_OWN_STEPS,
)

STEP_METRIC = MONITOR_PREFIX + "step"
_axis_declared: set = set()  # ids of the W&B runs whose x-axis is declared


def write_events(monitor, events: list, engine) -> None:
    """Write [(name, value, step)] of one optimizer step to every monitor ``monitor`` holds (rank 0's)."""
    wandb_monitor = getattr(monitor, MONITOR_WANDB, None)
    if wandb_monitor is None or not events:
        monitor.write_events(events)
        return
    for name in MONITORS_WITH_OWN_STEPS:
        m = getattr(monitor, name, None)
        if m is not None:
            m.write_events(events)
    import wandb

    if wandb.run is None:  # DeepSpeed only starts the run on rank 0
        return
    if wandb.run.id not in _axis_declared:
        wandb.define_metric(STEP_METRIC)
        wandb.define_metric(MONITOR_PREFIX + "*", step_metric=STEP_METRIC)
        _axis_declared.add(wandb.run.id)
    row = {name: value for name, value, _ in events}
    row[STEP_METRIC] = events[0][2]
    wandb.log(row, step=int(getattr(engine, ENGINE_SAMPLES)))
