"""DeepSpeed's parameter-swapper interface on our layer-group cache.

:class:`AidaptivParamSwapper` offers the interface DeepSpeed 0.19 expects of
``AsyncPartitionedParameterSwapper`` (``param.nvme_swapper``), so ZeRO-3's own status machine drives it:
DeepSpeed asks ``swap_in(params)`` for the partitions it is about to gather and calls
``remove_partition_and_release_buffers(params)`` when it is done with them. This module maps those calls
(DeepSpeed's parameters, ``ds_id``\\ s and partition statuses) onto :class:`~aidaptiv_ds.swap.layer_group_cache.
LayerGroupCache`, which does the reading, caching and writing.

Differences from DeepSpeed's swapper, and why:

- one file for all partitions of the rank, one 4 KiB-aligned extent each, laid out so that each layer group
  is contiguous on disk (relocated once at start if the model was built in another order);
- a layer group is read in one request into one slot of host memory; every partition of the group is a
  view into it. There is no buffer_count/buffer_size: the plan sizes the slots from the budget;
- a partition DeepSpeed asks for waits only for its own group's request, never for unrelated prefetches;
- groups stay in host memory after use while slots allow, and updated partitions are written through to
  the cached copy and to disk (see the cache).

Before :meth:`AidaptivParamSwapper.plan` (while the model is being built and DeepSpeed sets up its
optimizer) there are no groups: each partition moves alone through an ordinary aligned buffer.
"""

from __future__ import annotations

import gc
import weakref
from typing import Dict

import torch

from aidaptiv_ds.common.sizes import dtype_bytes
from aidaptiv_ds.swap.host_memory import aligned_empty, as_bytes
from aidaptiv_ds.swap.layer_group_cache import LayerGroupCache
from aidaptiv_ds.swap.partition_layout import ParamRecord


class ParamStatus:
    """Mirrors deepspeed.runtime.swap_tensor.partitioned_param_swapper.PartitionedParamStatus (set by
    :mod:`aidaptiv_ds.zero3.install`, so that this module imports no DeepSpeed)."""

    AVAILABLE = None
    NOT_AVAILABLE = None
    INFLIGHT = None


def _empty(dtype):
    # On the CPU by name, as partitions are: under zero.Init torch.empty defaults to the accelerator.
    return torch.empty(0, dtype=dtype, device="cpu")


class AidaptivParamSwapper:
    """DeepSpeed's parameter-swapper interface on our store. One per ``zero.Init`` / model.

    ``records`` maps DeepSpeed's ``ds_id`` to the partition's :class:`ParamRecord`; ``cache`` is the layer
    group cache, whose lock also guards ``records`` and the partitions' statuses."""

    def __init__(self, runtime):
        self.runtime = runtime
        runtime.param_swapper = self
        self.dtype = runtime.model_dtype
        self.swap_folder = runtime.space.path
        self.records: Dict[int, ParamRecord] = {}
        self.cache = LayerGroupCache(runtime.store, runtime.params_file, runtime.stats)
        self._lock = self.cache.lock
        self._init_buffers: Dict[int, torch.Tensor] = {}
        self._inflight_params: list = []
        self.invalid_buffer = _empty(self.dtype)

    # ---------------------------------------------------------------- DeepSpeed's interface
    def swappable_tensor(self, param=None, numel=None):
        # Every partition goes to NVMe, however small: small ones travel inside their layer group.
        return True

    def available_swap_in_buffers(self):
        # Only DeepSpeed's own NVMe prefetch asks; it is switched off (our prefetcher replaces it).
        return 1 << 30

    def get_path(self, param, must_exist=False):
        return self.runtime.params_file.path

    def get_buffer(self, param, numel):
        """First partitioning of ``param`` (model construction): allocate its extent and hand DeepSpeed an
        aligned buffer to fill; :meth:`swap_out_and_release` writes it."""
        with self._lock:
            rec = self.records.get(param.ds_id)
            if rec is None:
                ext = self.runtime.params_file.allocate(numel * dtype_bytes(param.dtype))
                rec = ParamRecord(param.ds_id, numel, param.dtype, ext, weakref.ref(param))
                self.records[param.ds_id] = rec
            buf = aligned_empty(rec.extent.reserved)
            self._init_buffers[param.ds_id] = buf
            return buf[: rec.nbytes].view(rec.dtype)

    def swap_out_and_release(self, params, async_op=False, force_buffer_release=False):
        """Write partitions that DeepSpeed filled through :meth:`get_buffer`, then release them."""
        tickets = []
        with self._lock:
            for p in params:
                rec = self.records[p.ds_id]
                buf = self._init_buffers.pop(p.ds_id, None)
                if buf is None:  # a published partition being swapped out: write its current values
                    buf = aligned_empty(rec.extent.reserved)
                    as_bytes(buf[: rec.nbytes]).copy_(as_bytes(p.ds_tensor.data))
                tickets.append(
                    (
                        self.runtime.store.write_span(rec.extent.file, rec.extent.offset, buf, f"partition {p.ds_id}"),
                        buf,
                    )
                )
        for t, _ in tickets:
            self.runtime.store.wait(t)
        self.remove_partition_and_release_buffers(params)

    def swap_in(self, params, async_op=True, swap_in_buffers=None):
        """Make the partitions of ``params`` available. With ``async_op`` their groups start loading and
        the partitions are marked in flight; :meth:`synchronize_reads` finishes them (DeepSpeed's
        contract). Otherwise this returns with them published. A partition waits for its own group's
        request only, never for unrelated prefetches."""
        if swap_in_buffers is not None:
            for p, buf in zip(params, swap_in_buffers):
                self.swap_into_buffer(p, buf)
            return
        if not async_op:
            self._publish(params)
            return
        cache = self.cache
        with self._lock:
            for p in params:
                rec = self.records[p.ds_id]
                if rec.published:
                    continue
                if rec.group is not None:
                    cache.start_loading(rec.group, reason=f"partition {p.ds_id}")  # pinned until synchronize_reads
                p.ds_tensor.status = ParamStatus.INFLIGHT
                self._inflight_params.append(p)

    def synchronize_reads(self):
        with self._lock:
            params, self._inflight_params = self._inflight_params, []
            self._publish(params)
            for p in params:
                g = self.records[p.ds_id].group
                if g is not None:
                    self.cache.unpin(g)

    def synchronize_writes(self):
        self.cache.drain_writes()

    def remove_partition_and_release_buffers(self, params):
        with self._lock:
            for p in params:
                rec = self.records.get(p.ds_id)
                if rec is not None and rec.published:
                    rec.published = False
                    if rec.group is not None:
                        self.cache.unpublish(rec.group)
                p.ds_tensor.data = _empty(p.ds_tensor.dtype)
                p.ds_tensor.status = ParamStatus.NOT_AVAILABLE

    def swap_into_buffer(self, param, dest_buffer):
        """Copy ``param``'s partition into ``dest_buffer`` without publishing it."""
        rec = self.records[param.ds_id]
        with self._lock:
            if self.runtime.optimizer_swapper is not None:
                self.runtime.optimizer_swapper.streamed_step.apply_pending(rec.ds_id)
            if rec.group is not None:
                self.cache.load(rec.group, reason=f"partition {param.ds_id}")
                src = rec.group.view(rec)
            else:
                src = self._read_alone(rec)
            dest_buffer.data.copy_(src)

    def reserve_partitioned_swap_space(self, partition_num_elems):
        pass  # buffers for updated partitions come from the pool when they are written

    def reserve_available_buffers(self):
        return []  # only DeepSpeed's fast_init path uses these; we configure fast_init off

    def release_reserved_buffers(self):
        pass

    def swap_out_partitioned_params(self, dst_fp16_params, src_fp32_params):
        """Write whole updated partitions (DeepSpeed's interface; the streamed step writes pieces)."""
        self.cache.write_pieces(
            [
                (self.records[p.ds_id], 0, self.records[p.ds_id].numel, src)
                for p, src in zip(dst_fp16_params, src_fp32_params)
            ]
        )

    # ---------------------------------------------------------------- layer groups
    def release_replaced(self) -> int:
        """Give back the swap space of partitions whose parameter no longer exists; returns how many.

        A model with tied embeddings built under ``zero.Init`` (SmolLM2, Qwen2.5 up to 3B, Llama 3.2, Gemma)
        first makes its LM head's own weight, which is partitioned into our swap space as soon as the head's
        ``__init__`` returns; transformers then ties the head to the embedding (``lm_head.weight =
        embed_tokens.weight``) and the head's first parameter is dropped. Its partition would otherwise stay:
        a vocabulary-by-hidden extent read with the "other" group, sizing every slot, and, belonging to no
        parameter of the model, impossible to save by name (the run would fail at its first checkpoint)."""
        gc.collect()  # DeepSpeed's per-parameter closures keep a dropped parameter in a reference cycle
        with self._lock:
            gone = [rec for rec in self.records.values() if rec.param() is None and rec.group is None]
            for rec in gone:
                del self.records[rec.ds_id]
                self._init_buffers.pop(rec.ds_id, None)
                self.runtime.params_file.release(rec.extent)
            return len(gone)

    def plan(self, module, layer_group_size: int, slots: int, retain: int = 0) -> None:
        """Form layer groups from the module structure and hand them to the cache with ``slots`` group
        buffers of the runtime's host memory, the last ``retain`` groups retained across the
        forward/backward turn. Called once the runtime has its pinned pool."""
        from aidaptiv_ds.zero3.layer_groups import partition_into_groups

        with self._lock:
            named = []
            seen = set()
            for name, params in partition_into_groups(module, layer_group_size):
                recs = []
                for p in params:
                    if p.ds_id in seen or p.ds_id not in self.records:
                        continue  # tied weights live in their first group; a parameter with no record never reached our swapper
                    seen.add(p.ds_id)
                    recs.append(self.records[p.ds_id])
                if recs:
                    named.append((name, recs))
            # Partitions DeepSpeed knows but the module walk did not reach (rare): one group at the end.
            rest = [r for i, r in self.records.items() if i not in seen]
            if rest:
                named.append(("other", rest))
            self.cache.plan(named, self.runtime.memory, slots, retain)

    def _publish(self, params) -> None:
        """Wait for each partition's group (loading it if needed) and hand DeepSpeed a view into it, with
        any optimizer update still pending for it applied first."""
        osw = self.runtime.optimizer_swapper
        step = osw.streamed_step if osw is not None else None
        cache = self.cache
        with self._lock:
            for p in params:
                rec = self.records[p.ds_id]
                if rec.published:
                    continue
                if step is not None and step.pending():
                    step.apply_pending(rec.ds_id)
                g = rec.group
                if g is None:
                    data = self._read_alone(rec)
                else:
                    cache.publish(g, reason=f"partition {p.ds_id}")
                    cache.note_use(g, backward=self.runtime.phase == "backward")
                    data = g.view(rec)
                p.ds_tensor.data = data
                p.ds_tensor.status = ParamStatus.AVAILABLE
                rec.published = True

    def _read_alone(self, rec: ParamRecord) -> torch.Tensor:
        buf = aligned_empty(rec.extent.reserved)
        self.runtime.store.wait(
            self.runtime.store.read_span(rec.extent.file, rec.extent.offset, buf, f"partition {rec.ds_id}")
        )
        return buf[: rec.nbytes].view(rec.dtype)
