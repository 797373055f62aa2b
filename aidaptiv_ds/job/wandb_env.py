"""W&B's environment for a training run whose DeepSpeed config turns on the "wandb" monitor section.

DeepSpeed 0.19.8's W&B monitor calls ``wandb.init(project=, group=, entity=)`` on rank 0 and nothing more; its
config section takes no mode and no folder (DeepSpeed refuses extra keys), so W&B reads them from the
environment. A run is offline unless the user says otherwise (``WANDB_MODE=online``): no account, no network,
no login prompt. Its files go to ``<run folder>/wandb/offline-run-<time>-<id>/`` (``run-<id>.wandb`` holds
every logged row) and ``wandb sync`` uploads them later from a machine that has a network.
"""

from __future__ import annotations

import os

from aidaptiv_ds.common.extras import install_command, missing

SECTION = "wandb"


def wandb_enabled(cfg: dict) -> bool:
    section = cfg.get(SECTION)
    return isinstance(section, dict) and bool(section.get("enabled"))


def prepare(cfg: dict, run_dir: str, env=None) -> dict:
    """Where the config enables W&B: check the package is there and set WANDB_MODE=offline and
    WANDB_DIR=``run_dir`` in ``env`` (os.environ by default) unless they are set already. Returns
    ``{"mode", "dir"}`` as the run will use them, or {} when W&B is off. Raises ValueError when the wandb
    package is missing (DeepSpeed would fail later, inside deepspeed.initialize)."""
    if not wandb_enabled(cfg):
        return {}
    if missing("wandb"):
        raise ValueError(
            f'the config\'s "{SECTION}" section is enabled but the wandb package is not installed: '
            f'{install_command("wandb")}, or set "enabled": false'
        )
    env = os.environ if env is None else env
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("WANDB_DIR", os.path.abspath(run_dir))
    # W&B writes to a temporary folder instead when WANDB_DIR does not exist or is not writable.
    os.makedirs(env["WANDB_DIR"], exist_ok=True)
    return {"mode": env["WANDB_MODE"], "dir": env["WANDB_DIR"]}
