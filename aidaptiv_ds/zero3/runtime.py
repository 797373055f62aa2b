"""What one rank's swappers share: the resolved settings, the I/O engine, the swap space, host memory and statistics.

A runtime is born when DeepSpeed builds the parameter swapper (inside ``zero.Init`` or the engine's
conversion of an ordinary module), at which point only the settings are known: parameters are written to
NVMe one by one from ordinary aligned buffers. When the ZeRO-3 optimizer is built, the model and its
sub-groups are known; :meth:`SwapRuntime.start_training` then sizes the one pinned pool from the model
(bounded by the host budget), reopens the files on an engine that registers that pool with io_uring, and
the swappers switch to group-granular, prefetched, pooled I/O.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from aidaptiv_ds.common.malloc_threshold import set_mmap_threshold, trim_heap
from aidaptiv_ds.config.settings import SwapSettings
from aidaptiv_ds.engine.file_size_limit import efbig_not_sigxfsz
from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.swap.host_memory import HostMemory
from aidaptiv_ds.swap.space import SwapSpace
from aidaptiv_ds.swap.store import SwapStore
from aidaptiv_ds.zero3 import compat

log = logging.getLogger(__name__)


class SwapStats:
    """Counters the training loop reads through ``engine.aidaptiv_stats()``."""

    def __init__(self):
        self.peak_pinned_bytes = 0
        self.io_wait_steps = []  # I/O wait of each optimizer step (forward + backward + step), seconds
        self.apply_steps = []  # time applying optimizer updates during each step (incl. deferred)
        self.optimizer_s = 0.0
        self.optimizer_apply_s = 0.0  # time spent applying optimizer updates (in step() or deferred)
        self.optimizer_apply_deferred_s = 0.0  # the part of it outside step(): in the next forward (or the
        # backward's flush of updates no forward fetched)
        self.deferred_apply_steps = []  # that part, for each step (applied in the forward after it)
        self.optimizer_io_wait_s = 0.0
        self.sync_param_reads = 0  # parameter fetches DeepSpeed asked for before our prefetch finished
        self.prefetched_groups = 0
        self.group_reads = 0
        self.group_hits = 0  # group needed and already in host memory
        self.group_read_bytes = 0  # bytes of layer groups read from NVMe
        self.retained_groups = 0  # the last layer groups of the forward, kept for the backward
        self.retained_bytes = 0  # their bytes
        self.retention_hits = 0  # backward uses of a retained group found in memory
        self.retention_avoided_read_bytes = 0  # the bytes of those groups: reads the retention saved
        self.heap_trims = 0  # malloc_trim calls (trim_heap) and the time they took
        self.heap_trim_s = 0.0


class SwapRuntime:
    def __init__(self, cfg: SwapSettings, rank: int, model_dtype: torch.dtype):
        self.cfg = cfg  # the resolved "aidaptiv" block, shared with the swappers, the planner and the prefetcher
        self.rank = rank
        self.model_dtype = model_dtype
        self.stats = SwapStats()
        # Before the model's tensors come and go: freed layer-sized buffers must leave the heap (the module says why).
        problem = set_mmap_threshold(cfg.malloc_mmap_threshold)
        if problem and rank == 0:
            log.warning("aidaptiv: %s", problem)
        # Where activations and gradients are host memory, the heap's holes are part of the peak RSS. "auto" is
        # decided at the first trim, in training, when DeepSpeed has chosen its accelerator.
        self.trim_heap = cfg.trim_heap if isinstance(cfg.trim_heap, bool) else None
        # The swap folder first: a second job on the same nvme_path fails here, before anything starts.
        self.space = SwapSpace(cfg.nvme_path, rank, keep_files=cfg.keep_swap_files)
        try:
            self.engine = self._make_engine(pool=None)
        except BaseException:
            self.space.close()
            raise
        if self.engine.fallback_reason and rank == 0:
            log.warning("aidaptiv: %s", self.engine.fallback_reason)
        self.store = SwapStore(self.engine, self.space)
        try:
            self.params_file = self.space.create_file("params.swp", self.engine)
        except BaseException:
            self.space.close()
            self.engine.shutdown()
            raise
        self.optim_file = None
        self.pool: Optional[PinnedPool] = None
        self.memory: Optional[HostMemory] = None
        self.training = False
        self.closed = False
        self.param_swapper = None  # set by AidaptivParamSwapper
        self.optimizer_swapper = None  # set by AidaptivOptimizerSwapper
        self.prefetcher = None  # set when the optimizer is built
        self.plan = None
        self.phase = "forward"  # "backward" between ZeRO-3's backward prologue and epilogue
        self._retired_stats = {"bytes_read": 0, "bytes_written": 0}

    def _make_engine(self, pool):
        c = self.cfg
        # The engine's threads start with SIGXFSZ blocked: a write past ulimit -f fails with EFBIG, named,
        # instead of killing the process, and the user's program keeps its own SIGXFSZ (file_size_limit).
        with efbig_not_sigxfsz():
            return IOEngine(
                backend=c.backend,
                block_size=c.block_size,
                queue_depth=c.queue_depth,
                threads=c.io_threads,
                pool=pool if c.register_buffers else None,
                sqpoll=c.sqpoll,
            )

    def writing(self):
        """A block in which this thread's writes through the engine (a checkpoint save) fail with EFBIG past
        ulimit -f rather than kill the process."""
        return efbig_not_sigxfsz()

    def start_training(self, pool_bytes: int) -> None:
        """Create the pinned pool (``pool_bytes``, already bounded by the budget) and move the swap files
        onto an engine that has it registered."""
        if self.training:
            return
        t0 = time.perf_counter()
        self.store.drain()
        self.pool = PinnedPool(pool_bytes)
        engine = self._make_engine(pool=self.pool)
        try:
            for f in self.space.files:
                # By path, but only if the path still leads to the file this runtime created.
                f.reopen(engine)
        except BaseException:
            engine.shutdown()
            raise
        self._retired_stats = self.engine.stats()
        self.engine.shutdown()
        self.engine = engine
        self.store.engine = engine
        self.memory = HostMemory(self.pool)
        self.training = True
        if self.rank == 0:
            s = self.pool.stats()
            log.info(
                "aidaptiv: pinned pool %.1f MiB (%s), engine %s%s, block_size %d KiB (%s), queue_depth %d (%s), "
                "ready in %.2fs",
                pool_bytes / 2**20,
                s["lock_method"],
                engine.backend.value,
                " with fixed buffers" if engine.fixed_buffers else "",
                self.cfg.block_size // 1024,
                self.cfg.block_size_source,
                self.cfg.queue_depth,
                self.cfg.queue_depth_source,
                time.perf_counter() - t0,
            )

    def create_optimizer_file(self):
        if self.optim_file is None:
            self.optim_file = self.space.create_file("optim.swp", self.engine)
        return self.optim_file

    def pinned_bytes(self) -> int:
        if self.pool is None:
            return 0
        s = self.pool.stats()
        self.stats.peak_pinned_bytes = max(self.stats.peak_pinned_bytes, s["high_water"])
        return s["in_use"]

    def release_heap(self) -> None:
        """Trim the heap (``trim_heap``): called at the end of a forward, a backward or a step, and by the
        prefetcher as the backward enters a layer group."""
        if self.trim_heap is None:
            self.trim_heap = compat.training_on_host()
        if self.trim_heap:
            t0 = time.perf_counter()
            trim_heap()
            self.stats.heap_trims += 1
            self.stats.heap_trim_s += time.perf_counter() - t0

    def stats_dict(self) -> dict:
        """Cumulative counters of this rank since the swapper was created."""
        e = self.engine.stats()
        self.pinned_bytes()
        s = self.stats
        return {
            "backend": e["backend"],
            "fixed_buffers": e["fixed_buffers"],
            "nvme_read_bytes": e["bytes_read"] + self._retired_stats["bytes_read"],
            "nvme_write_bytes": e["bytes_written"] + self._retired_stats["bytes_written"],
            "io_wait_s": list(s.io_wait_steps),
            "io_wait_total_s": self.store.io_wait_s,
            "optimizer_s": s.optimizer_s,
            "optimizer_io_wait_s": s.optimizer_io_wait_s,
            "optimizer_apply_s": s.optimizer_apply_s,
            "optimizer_apply_s_steps": list(s.apply_steps),
            "optimizer_apply_deferred_s": s.optimizer_apply_deferred_s,
            "optimizer_apply_deferred_s_steps": list(s.deferred_apply_steps),
            "pinned_bytes": self.pool.stats()["in_use"] if self.pool is not None else 0,
            "peak_pinned_bytes": s.peak_pinned_bytes,
            "sync_param_reads": s.sync_param_reads,
            "group_reads": s.group_reads,
            "group_hits": s.group_hits,
            "prefetched_groups": s.prefetched_groups,
            "group_read_bytes": s.group_read_bytes,
            "retained_groups": s.retained_groups,
            "retained_bytes": s.retained_bytes,
            "retention_hits": s.retention_hits,
            "retention_avoided_read_bytes": s.retention_avoided_read_bytes,
            "heap_trims": s.heap_trims,
            "heap_trim_s": s.heap_trim_s,
            "plan": self.plan.describe() if self.plan is not None else None,
        }

    def close(self) -> None:
        """Finish every request, close the files and remove them unless kept, and let go of the rank folder's
        lock. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            self.store.drain()
        finally:
            kept = self.space.close()
            self.engine.shutdown()
            if kept and self.rank == 0:
                log.warning("aidaptiv: swap files kept (keep_swap_files=true): %s", ", ".join(kept))
