"""How a training run fails: the failures that already carry their one-line explanation, and the exit codes
they map to (``aidaptiv-ds train`` returns them; the harness and the studio read them)."""

from __future__ import annotations

EXIT_OK, EXIT_ERROR, EXIT_OOM = 0, 1, 3


class TrainingFailed(Exception):
    """A failure that already has its one-line explanation."""


class DoesNotFit(TrainingFailed):
    """The launch guard's refusal: the plan says the swap space, host budget or host memory cannot hold the
    job (status "refused", exit status 3 as for an out-of-memory: nothing was trained or written)."""


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    # Host allocation failures surface as a plain RuntimeError from c10's CPU allocator.
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
