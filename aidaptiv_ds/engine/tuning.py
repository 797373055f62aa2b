"""Which block size and queue depth a swap disk gets: a short O_DIRECT sweep through our engine, the choice it
leads to, and the look-up the swapper makes when the ``"aidaptiv"`` block leaves them unset (``"auto"``).

DeepSpeed asks its users to sweep the aio settings of their disk by hand; ``aidaptiv-ds plan --nvme-path DIR`` runs
the sweep as part of its NVMe probe (:func:`aidaptiv_ds.planner.rates.probe_nvme`): every pair of
:data:`CANDIDATE_BLOCKS` x :data:`CANDIDATE_DEPTHS` writes a fresh file of :data:`SWEEP_BYTES` and reads it back
through one engine with those settings, best of :data:`SWEEP_REPEATS` passes (another process on the disk only
ever slows a pass down). The pair chosen (:func:`choose`) is the fastest at a write followed by a read of the
same bytes (what the swapper does with every layer group and optimizer chunk), and, among the pairs within
:data:`TIE` of it, the one with the fewest bytes in flight (block x depth: less of the disk's queue held by one
engine, and the same speed). The whole table is cached with the disk's bandwidths under its key
(:mod:`aidaptiv_ds.engine.machine_cache`), so a block that gives one of the two settings gets the best of the other
for it.

Nothing here is measured when a job starts: without a cached sweep for the disk, "auto" is the engine's
defaults (1 MiB, 32), and the settings say which of "config", "tuned" or "default" each value came from.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

from aidaptiv_ds.common.sizes import KiB, MiB
from aidaptiv_ds.engine.machine_cache import disk_key, load_cache

CANDIDATE_BLOCKS = (256 * KiB, 1 * MiB, 4 * MiB)
CANDIDATE_DEPTHS = (8, 32, 128)
SWEEP_BYTES = 64 * MiB
SWEEP_REPEATS = 2
TIE = 0.05
# The engine's own defaults (aidaptiv_ds.engine.io.DEFAULT_BLOCK_SIZE / DEFAULT_QUEUE_DEPTH; a test keeps them equal):
# what "auto" is on a disk that was never swept.
DEFAULT_BLOCK_SIZE = 1 * MiB
DEFAULT_QUEUE_DEPTH = 32
# The ranges the block accepts (config.AidaptivConfig); a cached row outside them is ignored.
BLOCK_RANGE = (4 * KiB, 64 * MiB)
DEPTH_RANGE = (1, 4096)

CONFIG, TUNED, DEFAULT = "config", "tuned", "default"


def time_write_read(engine, buf, directory: str, stem: str, repeats: int):
    """Write ``buf`` to a fresh file in ``directory`` and read it back, ``repeats`` times, with ``engine``;
    the files are removed. Returns the write and read bandwidths (bytes/s) of each repeat."""
    nbytes = buf.numel() * buf.element_size()
    writes, reads = [], []
    for i in range(repeats):
        path = os.path.join(directory, f"{stem}-{os.getpid()}-{i}")
        try:
            t0 = time.perf_counter()
            engine.write(buf, path)
            t1 = time.perf_counter()
            engine.read(buf, path)
            t2 = time.perf_counter()
        finally:
            if os.path.exists(path):
                os.unlink(path)
        writes.append(nbytes / (t1 - t0))
        reads.append(nbytes / (t2 - t1))
    return writes, reads


def sweep(
    directory: str,
    nbytes: int = SWEEP_BYTES,
    repeats: int = SWEEP_REPEATS,
    blocks=CANDIDATE_BLOCKS,
    depths=CANDIDATE_DEPTHS,
) -> List[Dict[str, float]]:
    """Write and read-back bandwidth (bytes/s, best of ``repeats``) of every block size x queue depth, one row
    each: ``{"block_size", "queue_depth", "write", "read"}``. The files are removed; the directory must take
    O_DIRECT (the caller checks)."""
    import torch

    from aidaptiv_ds.engine.io import IOEngine, PinnedPool

    pool = PinnedPool(nbytes)
    buf = pool.allocate(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    rows = []
    for block in blocks:
        for depth in depths:
            engine = IOEngine(block_size=block, queue_depth=depth, pool=pool)
            try:
                writes, reads = time_write_read(engine, buf, directory, f".aidaptiv-io-sweep-{block}-{depth}", repeats)
            finally:
                engine.close()
            rows.append({"block_size": block, "queue_depth": depth, "write": max(writes), "read": max(reads)})
    return rows


def _valid(row) -> bool:
    try:
        b, q, w, r = int(row["block_size"]), int(row["queue_depth"]), float(row["write"]), float(row["read"])
    except (KeyError, TypeError, ValueError):
        return False
    return (
        BLOCK_RANGE[0] <= b <= BLOCK_RANGE[1]
        and b % (4 * KiB) == 0
        and DEPTH_RANGE[0] <= q <= DEPTH_RANGE[1]
        and w > 0
        and r > 0
    )


def _speed(row) -> float:
    """Bytes/s of a write followed by a read of the same bytes."""
    return 1.0 / (1.0 / row["write"] + 1.0 / row["read"])


def choose(
    table: List[dict], block_size: Optional[int] = None, queue_depth: Optional[int] = None
) -> Optional[Tuple[int, int]]:
    """(block size, queue depth) from a sweep table: the fastest pair, or among pairs within TIE of it the one
    with the fewest bytes in flight; only pairs with the given ``block_size``/``queue_depth`` when one is given.
    None when no row qualifies."""
    rows = [
        r
        for r in table or []
        if _valid(r)
        and (block_size is None or int(r["block_size"]) == block_size)
        and (queue_depth is None or int(r["queue_depth"]) == queue_depth)
    ]
    if not rows:
        return None
    best = max(_speed(r) for r in rows)
    near = [r for r in rows if _speed(r) >= (1 - TIE) * best]
    pick = min(near, key=lambda r: (int(r["block_size"]) * int(r["queue_depth"]), -_speed(r)))
    return int(pick["block_size"]), int(pick["queue_depth"])


def cached_sweep(directory: str, cache_file: Optional[str] = None) -> Optional[List[dict]]:
    """The sweep table cached for the disk under ``directory``; None when it was never swept (or the
    directory cannot be looked at yet)."""
    try:
        key = disk_key(directory)
    except OSError:
        return None
    table = (load_cache(cache_file).get(key) or {}).get("io_sweep")
    return table if isinstance(table, list) and any(_valid(r) for r in table) else None


def resolve_io(
    directory: str, block_size: Optional[int], queue_depth: Optional[int], cache_file: Optional[str] = None
) -> Tuple[int, int, str, str]:
    """(block size, queue depth, where the block size came from, where the queue depth came from) for a swap
    directory; ``None`` is "auto". A given value is the config's; an "auto" one is the cached sweep's choice
    (with the other value as given, when the sweep measured it), else the engine's default."""
    sources = [CONFIG if block_size is not None else DEFAULT, CONFIG if queue_depth is not None else DEFAULT]
    if block_size is None or queue_depth is None:
        table = cached_sweep(directory, cache_file)
        pick = (choose(table, block_size, queue_depth) or choose(table)) if table else None
        if pick is not None:
            if block_size is None:
                block_size, sources[0] = pick[0], TUNED
            if queue_depth is None:
                queue_depth, sources[1] = pick[1], TUNED
    return (
        DEFAULT_BLOCK_SIZE if block_size is None else block_size,
        DEFAULT_QUEUE_DEPTH if queue_depth is None else queue_depth,
        sources[0],
        sources[1],
    )
