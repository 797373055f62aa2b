"""The train job's checkpoints: which folder and tag ``--resume`` means, and the RNG state saved with a
checkpoint and restored from it."""

from __future__ import annotations

import os
import random

from aidaptiv_ds.job.args import TrainingFailed


def _resolve_resume(path: str) -> tuple[str, str | None]:
    """(load_dir, tag) for a save dir (tag from its 'latest') or a tag directory inside one."""
    if not os.path.isdir(path):
        raise TrainingFailed(
            f"--resume-from {path} does not exist: give a --save-dir of an earlier run or a tag directory inside it"
        )
    if os.path.exists(os.path.join(path, "latest")):
        return path, None
    parent = os.path.dirname(os.path.normpath(path))
    if any(f.endswith("model_states.pt") for f in os.listdir(path)):
        return parent, os.path.basename(os.path.normpath(path))
    raise TrainingFailed(f"--resume-from {path} holds no DeepSpeed checkpoint (no 'latest' file, no *model_states.pt)")


def _rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
