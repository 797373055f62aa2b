"""The training job's options beyond a benchmark loop, and what they decide before DeepSpeed starts.

One job: the flags for epochs, held-out evaluation, learning-rate schedule and ``--resume auto`` (added to
``aidaptiv-ds train`` by ``add_arguments``), their checks (every problem at once), and the plain arithmetic
they imply: how many optimizer steps a run makes, when it evaluates, which checkpoint it resumes. Nothing here
imports torch or DeepSpeed; aidaptiv_ds.job.train wires the results into the run.
"""

from __future__ import annotations

import math
import os

DEFAULT_STEPS = 10


def add_arguments(data, schedule, checkpoints) -> None:
    """This module's flags, into the train job's argument groups (or one parser given three times)."""
    from aidaptiv_ds.job.lr_schedule import SCHEDULES

    schedule.add_argument(
        "--epochs",
        type=float,
        default=None,
        metavar="N",
        help="passes over the training data (the records not held out; fractions allowed): sets the "
        "number of optimizer steps to ceil(N x training tokens / tokens per step). With --steps "
        "as well, the run stops at whichever comes first. Default: none (--steps decides)",
    )
    data.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out this fraction of the records (picked from --seed, at least one) for evaluation; "
        "they are never trained on. Default 0: no held-out split (every record trains)",
    )
    data.add_argument(
        "--eval-data",
        default=None,
        metavar="FILE|DIR",
        help="evaluate on this data instead (same forms as --data); not with --eval-fraction",
    )
    schedule.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="with held-out data, its loss every N optimizer steps as well as after the last one "
        "(0, the default: after the last only). Goes to the metrics (eval_losses) and to the "
        "config's monitors (aidaptiv/eval_loss)",
    )
    schedule.add_argument(
        "--lr-schedule",
        choices=tuple(SCHEDULES),
        default=None,
        help="learning-rate schedule over the run's optimizer steps, from the optimizer's lr (the "
        "config's or --lr): constant, linear or cosine decay to 0, each after --warmup-steps; "
        "replaces the config's scheduler section. Default: the config's scheduler, if any",
    )
    schedule.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="K",
        help="optimizer steps of linear lr warm-up from 0 for --lr-schedule (not --warmup, which only "
        "leaves steps out of the timing medians); default 0",
    )
    checkpoints.add_argument(
        "--resume",
        choices=("auto",),
        default=None,
        help="auto: resume from the latest checkpoint in --save-dir, or start fresh (saying so) when "
        "there is none; for a given checkpoint use --resume-from",
    )


def problems(args) -> list[str]:
    """Every problem with the options of this module, as one-line messages (empty when none)."""
    from aidaptiv_ds.job.lr_schedule import problems as schedule_problems

    out = []
    if args.steps is not None and args.steps < 1:
        out.append(f"--steps {args.steps} must be at least 1")
    if args.epochs is not None and not (args.epochs > 0 and math.isfinite(args.epochs)):
        out.append(f"--epochs {args.epochs} must be a positive number")
    if not 0.0 <= args.eval_fraction < 1.0:
        out.append(f"--eval-fraction {args.eval_fraction} must be at least 0 and below 1")
    if args.eval_fraction and args.eval_data:
        out.append("--eval-fraction and --eval-data both name held-out data: give one")
    if args.eval_every < 0:
        out.append(f"--eval-every {args.eval_every} must not be negative")
    if args.eval_every and not (args.eval_fraction or args.eval_data):
        out.append("--eval-every needs held-out data: give --eval-fraction F or --eval-data FILE")
    if args.resume and args.resume_from:
        out.append("--resume auto and --resume-from both choose a checkpoint: give one")
    if args.resume == "auto" and not args.save_dir:
        out.append("--resume auto looks for the latest checkpoint in --save-dir: give --save-dir")
    # The check against the step count comes later: with --epochs it is known once the data is read.
    out += schedule_problems(args.lr_schedule, args.warmup_steps, None)
    return out


def total_steps(steps: int | None, epochs: float | None, epoch_tokens: int, tokens_per_step: int) -> int:
    """Optimizer steps of the run: --steps, or enough for --epochs passes over ``epoch_tokens`` (the last step
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
            f"--resume auto: {latest} names the checkpoint {tag!r}, which is not in {save_dir}: "
            "restore that folder, or give --resume-from with another tag folder"
        )
    return folder


def checkpoint_candidates(save_dir: str) -> list[str]:
    """The tag folders ``--resume auto`` tries, in order: the one 'latest' names (put back first if a save was
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
