"""This node, as far as the host budget depends on it: the ranks sharing it, one rank's budget in bytes, and the
check that the budget fits the node's RAM (or its memory cgroup's limit) and its memlock limit, which
:mod:`aidaptiv_ds.engine.machine` reads."""

from __future__ import annotations

import os
from typing import List, Optional

from aidaptiv_ds.common.sizes import GiB, MiB
from aidaptiv_ds.config.schema import (
    BLOCK,
    PER_NODE,
    AidaptivConfig,
    parse_host_budget,
    parse_retention,
)
from aidaptiv_ds.engine import machine  # by module: tests replace machine.total_ram_bytes and memlock_limit

# Where launchers say how many ranks run on this node: torchrun/accelerate, the deepspeed launcher, Open MPI.
LOCAL_RANK_COUNT_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def local_rank_count(env=None) -> int:
    """Ranks of this job on this node, from the launcher's environment; 1 without a launcher."""
    env = os.environ if env is None else env
    for name in LOCAL_RANK_COUNT_VARS:
        text = (env.get(name) or "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def budget_bytes(host_memory_budget, ram_bytes: Optional[int], local_ranks: Optional[int] = None) -> int:
    """One rank's budget in bytes: a share of RAM is a share of ``ram_bytes`` (read here when None), and a
    per-node amount is split between ``local_ranks`` (read from the launcher's environment when None)."""
    nbytes, fraction, scope = parse_host_budget(host_memory_budget)
    if fraction is not None:
        nbytes = int(fraction * (ram_bytes if ram_bytes is not None else machine.total_ram_bytes()))
    if scope == PER_NODE:
        nbytes //= local_ranks or local_rank_count()
    return nbytes


def check_host_budget(cfg: AidaptivConfig, ram_bytes: int, local_ranks: Optional[int] = None) -> List[str]:
    """Problems of the budget as the node sees it (all its ranks together), before anything is pinned.

    Refused: a total over the node's RAM (the ranks would be killed or swap). Warned about, not refused: a
    total over the locked-memory limit, since nothing fails then; the pool falls back to unlocked memory and
    io_uring to unregistered buffers, which only costs speed (mlock counts a rank's pool against the limit;
    io_uring counts every registration of the user together)."""
    ranks = local_ranks or local_rank_count()
    per_rank = budget_bytes(cfg.host_memory_budget, ram_bytes, ranks)
    problems = []
    retention = parse_retention(cfg.retention_budget)
    if retention >= per_rank:
        # The exact room (the budget less the swapper's minimum) is known once the model is: the run's plan
        # checks it before training. A retention as large as the whole budget can never fit.
        problems.append(
            f"{BLOCK}.retention_budget {cfg.retention_budget!r} ({retention / MiB:.1f} MiB) is not below this "
            f"rank's host_memory_budget ({per_rank / MiB:.1f} MiB), which it is part of: lower it (the run's plan "
            "says how much fits beyond the swapper's minimum)"
        )
    node = per_rank * ranks
    if node > ram_bytes:
        share = (
            f"each of the {ranks} ranks on this node {per_rank / GiB:.2f} GiB, {node / GiB:.2f} GiB together"
            if ranks > 1
            else f"{per_rank / GiB:.2f} GiB"
        )
        return problems + [
            f"{BLOCK}.host_memory_budget {cfg.host_memory_budget!r} gives {share}, but this node may use "
            f"{ram_bytes / GiB:.2f} GiB of RAM (the machine's, or its cgroup's limit): lower it (a share such "
            'as "25%" or a size per node such as "64GiB/node" is split between the node\'s ranks)'
        ]
    limit = machine.memlock_limit()
    pinned = node if cfg.register_buffers else per_rank
    if limit is not None and pinned > limit and os.environ.get("LOCAL_RANK", "0") == "0":
        import logging

        logging.getLogger(__name__).warning(
            "aidaptiv: host_memory_budget lets %s pin up to %.2f GiB but the locked-memory limit (ulimit -l) is "
            "%.2f MiB: pools over it run unlocked and io_uring without fixed buffers (slower, nothing lost); "
            "raise it (memlock in /etc/security/limits.conf, LimitMEMLOCK= for systemd, --ulimit memlock=-1 "
            "for docker)",
            f"the {ranks} ranks on this node" if ranks > 1 else "this rank",
            pinned / GiB,
            limit / MiB,
        )
    return problems
