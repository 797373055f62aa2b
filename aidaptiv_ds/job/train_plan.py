"""The training run's settings beyond a benchmark loop, and what they decide before DeepSpeed starts.

One job: the checks of the settings (every problem at once: the numbers of the schedule, held-out evaluation,
learning-rate schedule and ``resume``; the places the run writes are checked on disk by
:meth:`aidaptiv_ds.job.train.Run.prepare`, with :func:`output_problems`), and the plain arithmetic they imply: how many optimizer steps a run makes, when it
evaluates, which checkpoint it resumes. Nothing here imports torch or DeepSpeed; aidaptiv_ds.job.train wires the
results into the run.
"""

from __future__ import annotations

import math
import os

DEFAULT_STEPS = 10


def problems(args) -> list[str]:
    """Every problem with the options of this module, as one-line messages (empty when none)."""
    from aidaptiv_ds.job.lr_schedule import problems as schedule_problems

    out = []
    if args.seq_len < 1:
        out.append(f"`seq_len` {args.seq_len} must be at least 1")
    if args.micro_batch is not None and args.micro_batch < 1:
        out.append(f"`micro_batch` {args.micro_batch} must be at least 1 (sequences per rank per micro-step)")
    if args.grad_accum is not None and args.grad_accum < 1:
        out.append(f"`grad_accum` {args.grad_accum} must be at least 1 (micro-steps per optimizer step)")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr >= 0):
        out.append(f"`lr` {args.lr} must be a finite number, 0 or more (e.g. 1e-5)")
    if args.save_every < 0:
        out.append(f"`save_every` {args.save_every} must not be negative")
    if args.warmup < 0:
        out.append(f"`warmup` {args.warmup} must not be negative")
    if args.steps is not None and args.steps < 1:
        out.append(f"`steps` {args.steps} must be at least 1")
    if args.epochs is not None and not (args.epochs > 0 and math.isfinite(args.epochs)):
        out.append(f"`epochs` {args.epochs} must be a positive number")
    if not 0.0 <= args.eval_fraction < 1.0:
        out.append(f"`eval_fraction` {args.eval_fraction} must be at least 0 and below 1")
    if args.eval_fraction and args.eval_data:
        out.append("`eval_fraction` and `eval_data` both name held-out data: give one")
    if args.eval_every < 0:
        out.append(f"`eval_every` {args.eval_every} must not be negative")
    if args.eval_every and not (args.eval_fraction or args.eval_data):
        out.append("`eval_every` needs held-out data: give `eval_fraction` F or `eval_data` FILE")
    coef = getattr(args, "router_aux_loss_coef", None)
    if coef is not None and not (math.isfinite(coef) and coef >= 0):
        out.append(f"`router_aux_loss_coef` {coef} must be a finite number, 0 or more (0: no load-balancing loss)")
    if not args.peer_timeout > 0:
        out.append(f"`peer_timeout` {args.peer_timeout} must be a positive number of seconds")
    if args.keep_last < 0:
        out.append(f"`keep_last` {args.keep_last} must not be negative")
    if args.keep_last and not args.save_dir:
        out.append("`keep_last` prunes the checkpoints in `save_dir`: give `save_dir`")
    if args.resume and args.resume_from:
        out.append("`resume` auto and `resume_from` both choose a checkpoint: give one")
    if args.resume == "auto" and not args.save_dir:
        out.append("`resume` auto looks for the latest checkpoint in `save_dir`: give `save_dir`")
    # The check against the step count comes later: with --epochs it is known once the data is read.
    out += schedule_problems(args.lr_schedule, args.warmup_steps, None)
    return out


def output_problems(args) -> list[str]:
    """Every place the run will write that cannot take its files, one sentence each (empty when none): the
    checkpoints' folder (``save_dir``), the model's (``output_dir``), the metrics and logits files. Each is tried
    on disk as the write will meet it (aidaptiv_ds.common.destinations), so a read-only or unwritable destination
    stops the run before its first step instead of after its last."""
    from aidaptiv_ds.common.destinations import file_problem, folder_problem

    found = [
        folder_problem(args.save_dir, "`save_dir`") if args.save_dir else None,
        folder_problem(args.output_dir, "`output_dir`") if args.output_dir else None,
        file_problem(args.metrics_out, "`metrics_out`") if args.metrics_out else None,
        file_problem(args.logits_out, "`logits_out`") if args.logits_out else None,
    ]
    return [p for p in found if p]


def total_steps(steps: int | None, epochs: float | None, epoch_tokens: int, tokens_per_step: int) -> int:
    """Optimizer steps of the run: ``steps``, or enough for ``epochs`` passes over ``epoch_tokens`` (the last step
    may run into the next pass), or the smaller of the two when both are given."""
    if epochs is None:
        return DEFAULT_STEPS if steps is None else steps
    by_epochs = max(1, math.ceil(epochs * epoch_tokens / tokens_per_step))
    return by_epochs if steps is None else min(steps, by_epochs)


def eval_due(step: int, every: int, last: int) -> bool:
    """Whether the held-out loss is computed after optimizer step ``step`` (1-based) of a run ending at ``last``."""
    return step == last or (every > 0 and step % every == 0)


def latest_checkpoint(save_dir: str) -> str | None:
    """The tag folder DeepSpeed's 'latest' file in ``save_dir`` names, or None when there is no 'latest' yet
    (no folder, or nothing saved); ValueError when 'latest' names a folder that is not there."""
    latest = os.path.join(save_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        tag = f.read().strip()
    folder = os.path.join(save_dir, tag)
    if not tag or not os.path.isdir(folder):
        raise ValueError(
            f"`resume` auto: {latest} names the checkpoint {tag!r}, which is not in {save_dir}: "
            "restore that folder, or give `resume_from` with another tag folder"
        )
    return folder


def checkpoint_candidates(save_dir: str) -> list[str]:
    """The tag folders ``resume="auto"`` tries, in order: the one 'latest' names (put back first if a save was
    cut between its renames; skipped if it is gone), then every other completed tag (a folder with a DeepSpeed
    model state), newest first by the step number in its name. Staging and set-aside folders
    (``.<tag>.saving``, ``.<tag>.previous``) are never candidates."""
    from aidaptiv_ds.common import durable

    try:
        with open(os.path.join(save_dir, "latest")) as f:
            durable.recover(save_dir, f.read().strip())  # a save interrupted between its two renames
    except OSError:
        pass
    try:
        first = latest_checkpoint(save_dir)
    except ValueError:  # 'latest' names a tag that is gone: the others are still candidates
        first = None
    out = [first] if first else []

    def step_of(name: str) -> int:
        digits = "".join(ch if ch.isdigit() else " " for ch in name).split()
        return int(digits[-1]) if digits else -1

    others = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        folder = os.path.join(save_dir, name)
        if name.startswith(".") or folder == first or not os.path.isdir(folder) or os.path.islink(folder):
            continue
        if any(f.endswith("model_states.pt") for f in os.listdir(folder)):
            others.append((step_of(name), name, folder))
    return out + [folder for _, _, folder in sorted(others, reverse=True)]
