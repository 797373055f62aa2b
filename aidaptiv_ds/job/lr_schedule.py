"""Learning-rate schedules with warm-up for ``aidaptiv-ds train --lr-schedule``.

One job: turn (schedule name, warm-up steps, total optimizer steps) into the scheduler DeepSpeed steps once per
optimizer step. The schedules are the ones the Hugging Face Trainer uses (transformers.get_scheduler), so a
run here and a Trainer run with the same settings follow the same curve:

- ``constant``: the lr rises linearly from 0 over the warm-up steps, then stays at the optimizer's lr;
- ``linear``: the same warm-up, then a straight line down to 0 at the last step;
- ``cosine``: the same warm-up, then half a cosine down to 0 at the last step.

As in the Trainer, the factor for optimizer step ``s`` (0-based) during warm-up is ``s / warmup_steps``: the
first step of a warm-up runs at lr 0.

They are torch LambdaLR objects handed to deepspeed.initialize as a callable (DeepSpeed calls it with its
optimizer once that exists). DeepSpeed's own config schedulers were not used: in DeepSpeed 0.19.8 WarmupLR and
its kin raise warm-ups shorter than 2 steps to 2 and reject 0, and WarmupCosineLR ends at cos_min_ratio, not 0.
DeepSpeed saves the scheduler's state in every checkpoint and loads it with the optimizer's (which carries the
lr of the next step), so a resumed run continues on the same curve.
"""

from __future__ import annotations

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def problems(schedule: str | None, warmup_steps: int, total_steps: int | None) -> list[str]:
    """What is wrong with these settings (empty when nothing is), for the job's checks before training;
    ``total_steps`` None leaves out the check that needs it."""
    out = []
    if schedule is not None and schedule not in SCHEDULES:
        out.append(f"`lr_schedule` {schedule} is not one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0:
        out.append(f"`warmup_steps` {warmup_steps} must not be negative")
    if schedule is None and warmup_steps:
        out.append(
            "`warmup_steps` needs `lr_schedule` (constant, linear or cosine): without it the lr is the "
            "config's (its scheduler section, if any)"
        )
    if schedule in ("linear", "cosine") and total_steps is not None and warmup_steps >= total_steps:
        out.append(
            f"`warmup_steps` {warmup_steps} is not below the run's {total_steps} optimizer step(s): the "
            f"{schedule} decay would never start; use fewer warm-up steps"
        )
    return out


def scheduler_factory(schedule: str, warmup_steps: int, total_steps: int):
    """A callable optimizer -> LambdaLR, for ``deepspeed.initialize(lr_scheduler=...)``."""
    found = problems(schedule, warmup_steps, total_steps)
    if found:
        raise ValueError(found[0])

    def make(optimizer):
        import warnings

        from transformers import get_scheduler

        # PyTorch warns "Detected call of `lr_scheduler.step()` before `optimizer.step()`" when it has not seen
        # the optimizer's own step() run first. Under ZeRO-3 DeepSpeed steps the partitions through its own
        # optimizer, so the counter torch wraps around optimizer.step never moves and the warning, printed on
        # every run with a schedule, is always false here: the schedule steps after each optimizer step.
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
        )

        return get_scheduler(
            SCHEDULES[schedule], optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
        )

    return make
