"""How a training run fails: the failures that already carry their one-line explanation, and the exit codes
they map to (``aidaptiv-ds train`` returns them; the harness and the studio read them)."""

from __future__ import annotations

import os
import re

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


# gloo's error when a peer's connection breaks names the peer by address only: "Read error
# [10.231.0.12]:47817: Connection reset by peer", "Connection closed by peer [10.0.0.2]:1234".
_PEER = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")
_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused", "Timed out")


def name_lost_peer(error: str, peers: list | None) -> str:
    """``error`` with the rank(s) and host behind the address gloo names when a peer's connection broke:
    ``peers`` is every rank's (rank, host, address) as gathered at start (train.Run.build). Unchanged when
    the error is not such a failure or the address is not a known peer's."""
    m = _PEER.search(error or "")
    if not m or not peers or not any(s in error for s in _LOST):
        return error
    ranks = [(r, h) for r, h, addr in peers if addr == m.group(1)]
    if not ranks:
        return error
    hosts = sorted({h for _, h in ranks})
    who = ", ".join(f"rank {r}" for r, _ in ranks)
    return f"lost {who} on {'/'.join(hosts)} ({m.group(1)}): its node or process went away. {error}"


def gather_peers(world_size: int) -> list | None:
    """Every rank's (rank, host, address it reaches MASTER_ADDR from), gathered once at start, so that a failure
    on a peer's broken connection, which gloo names by address only, can name the lost rank and its node
    (failures.name_lost_peer). None for one process."""
    if world_size < 2:
        return None
    import socket

    import torch.distributed as dist

    addr = ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: the route's source
            s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))))
            addr = s.getsockname()[0]
    except OSError:
        pass
    peers = [None] * world_size
    dist.all_gather_object(peers, (dist.get_rank(), socket.gethostname(), addr))
    return peers
