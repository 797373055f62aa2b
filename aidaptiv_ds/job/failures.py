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


# A collective that waited longer than the process group's timeout (train's `peer_timeout`): gloo's "Timed out
# waiting 20000ms for recv operation to complete", nccl's watchdog "collective operation timeout". Neither names
# the peer: a cut link or a frozen node is silent, so the survivor cannot tell which of the others went away.
_SILENT = re.compile(r"Timed out waiting \d+ ?ms|collective operation timeout")


def explain_peer_failure(error: str, peers: list | None, rank: int, timeout_s: float) -> str:
    """``error`` explained when it is a peer's failure: a broken connection names the lost rank
    (:func:`name_lost_peer`); a collective that timed out says how long it waited and which ranks it waited
    for. Unchanged otherwise."""
    named = name_lost_peer(error, peers)
    if named != error or not error or not peers or not _SILENT.search(error):
        return named
    others = ", ".join(f"rank {r} on {h} ({a})" for r, h, a in peers if r != rank)
    return (
        f"no answer from the other ranks for {timeout_s:g} s (`peer_timeout`): one of them, its node or the link "
        f"to it went away ({others}); check those nodes, then resume from the last checkpoint. {error}"
    )


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
