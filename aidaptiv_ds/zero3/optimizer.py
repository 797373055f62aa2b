"""ZeRO-3's optimizer with our swappers wired in.

:class:`AidaptivZeroOptimizer` subclasses DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3`` and is installed
in its place (see :mod:`aidaptiv_ds.zero3.install`). When the config has no enabled ``"aidaptiv"`` block
every override defers to DeepSpeed unchanged. When it has one:

- ``_configure_tensor_swapping`` plans the run (layer groups, pinned pool size, optimizer sub-groups kept
  resident in host memory), creates :class:`AidaptivOptimizerSwapper` instead of DeepSpeed's, and hooks the
  layer-group prefetcher into the parameter coordinator;
- ``_setup_for_real_optimizer`` does DeepSpeed's set-up without its host buffer of every gradient
  partition (4 bytes per parameter outside any budget): gradients go to per-sub-group buffers instead;
- ``partition_grads`` opens a reduce bucket's gradient buffers as one block first (see
  :meth:`~aidaptiv_ds.zero3.gradients.SubGroupGradients.open_bucket`);
- ``_constant_buffered_norm2`` (a gradient partition's norm for clipping) skips DeepSpeed's fp64 copy, and on
  one rank ``__avg_scatter_grads`` hands the gradients over instead of reduce-scattering them to itself;
- ``step`` and the backward hooks record where the time goes.
"""

from __future__ import annotations

import logging
import time

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from aidaptiv_ds.config.schema import block_of
from aidaptiv_ds.zero3 import compat
from aidaptiv_ds.zero3.gradients import GradientPartitions, partition_norm
from aidaptiv_ds.zero3.optimizer_swapper import AidaptivOptimizerSwapper
from aidaptiv_ds.zero3.param_swapper import AidaptivParamSwapper
from aidaptiv_ds.zero3.plan import plan_run
from aidaptiv_ds.zero3.prefetch import LayerGroupPrefetcher

log = logging.getLogger(__name__)


def _runtime_of(module):
    for p in module.parameters():
        swapper = getattr(p, "nvme_swapper", None)
        if isinstance(swapper, AidaptivParamSwapper):
            return swapper.runtime
    return None


def _no_gather(param_list=None, async_op=False, hierarchy=0):
    return None


class AidaptivZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    def __init__(self, module, init_optimizer, param_names, *args, ds_config=None, **kwargs):
        # Whether our swappers run; the runtime itself is found in _configure_tensor_swapping, after
        # DeepSpeed has partitioned a model that was not built under zero.Init.
        self._aidaptiv_enabled = bool((block_of(ds_config) or {}).get("enabled"))
        self._aidaptiv = None
        super().__init__(module, init_optimizer, param_names, *args, ds_config=ds_config, **kwargs)

    # ------------------------------------------------------------------ set-up
    def create_reduce_and_remove_grad_hooks(self):
        # DeepSpeed 0.19.8 gathers every parameter before it registers the parameter's gradient hook (and
        # partitions it again after). With torch >= 2.1 the hook is register_post_accumulate_grad_hook, which needs
        # no data; with our swapper each gather is a read of that parameter from NVMe, so start-up read the
        # whole model once, one parameter at a time (10.8 s of 38 s for tinyllama-1.1b here). Gathers are
        # skipped while the hooks are made; partition() leaves a parameter that is not gathered as it is.
        if not self._aidaptiv_enabled or not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return super().create_reduce_and_remove_grad_hooks()
        params = [p for group in self.fp16_groups for p in group]
        gathers = [p.all_gather for p in params]
        try:
            for p in params:
                p.all_gather = _no_gather
            return super().create_reduce_and_remove_grad_hooks()
        finally:
            for p, gather in zip(params, gathers):
                p.all_gather = gather

    def _configure_tensor_swapping(self, offload_optimizer_config, aio_config):
        if not self._aidaptiv_enabled:
            return super()._configure_tensor_swapping(offload_optimizer_config, aio_config)
        runtime = _runtime_of(self.module)
        if runtime is None:
            raise RuntimeError(
                "the config enables aidaptiv but the model's parameters were partitioned without our swapper "
                '(by a zero.Init that did not see the "aidaptiv" block): build the model under '
                "aidaptiv_ds.zero_init(config), or plainly and let deepspeed.initialize partition it"
            )
        self._aidaptiv = runtime
        replaced = runtime.param_swapper.release_replaced()  # a tied head's first weight, before the plan counts it
        if replaced and dist.get_rank() == 0:
            log.info("aidaptiv: released %d partition(s) of parameters the model replaced (tied weights)", replaced)
        sub_group_numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
        plan = plan_run(runtime, self.module, sub_group_numels)
        runtime.plan = plan
        runtime.start_training(plan.pool_bytes)
        runtime.param_swapper.plan(self.module, plan.layer_group_size, plan.group_slots, plan.retained_groups)
        # On an accelerator ZeRO-3 copies gradient partitions into our host buffers without blocking; the
        # buffers wait for those copies by stream before they are written out. DeepSpeed's CPU accelerator
        # copies synchronously: nothing to wait for.
        accelerator = get_accelerator()
        current_stream = None if accelerator.is_synchronized_device() else accelerator.current_stream
        swapper = AidaptivOptimizerSwapper(runtime, self.optimizer, self, plan.chunk_numel, current_stream)
        records = runtime.param_swapper.records
        positions = {}
        for i, group in enumerate(self.fp16_groups):
            members, offset = [], 0
            for p in group:
                n = p.partition_numel()
                members.append((records[p.ds_id], offset, n))
                offset += n
            key = f"{self.fp16_partitioned_groups_flat_id[i][0]}_{self.fp16_partitioned_groups_flat_id[i][-1]}"
            sg = swapper.register(i, key, members, resident=i in plan.resident_sub_groups)
            for rec, off, n in members:
                positions[rec.ds_id] = (sg, off, n)
        self._aidaptiv_positions = positions
        self.optimizer_swapper = swapper
        coordinator = self.parameter_offload.get_param_coordinator()
        if current_stream is not None:
            # DeepSpeed copies fetched partitions out of our slots on its all-gather stream and releases them
            # after waiting on the default stream only: a slot may change only once both have passed the copies.
            from aidaptiv_ds.swap.host_memory import CudaSlotFence

            gather_stream = getattr(coordinator, "_PartitionedParameterCoordinator__allgather_stream", None)
            streams = [s for s in (gather_stream,) if s is not None]
            runtime.param_swapper.cache.slots.fence = CudaSlotFence(lambda: [current_stream(), *streams])
        runtime.prefetcher = LayerGroupPrefetcher(runtime, self.module)
        runtime.prefetcher.attach(coordinator)
        if dist.get_rank() == 0:
            log.info("aidaptiv: %s", plan.describe())

    def _setup_for_real_optimizer(self):
        if self._aidaptiv is None:
            return super()._setup_for_real_optimizer()
        # DeepSpeed's sequence, minus the host buffer holding every gradient partition of the model.
        self._create_fp32_partitions()
        dist.barrier()
        self._create_next_swappable_fp32_groups()
        self.initialize_optimizer_states()
        dist.barrier()
        if self.contiguous_gradients and self._gradients_need_no_bucket():
            # DeepSpeed copies each gradient into the bucket's flat buffer so that one collective can reduce the
            # bucket; on one rank on the CPU there is nothing to reduce, and __avg_scatter_grads (below) hands the
            # gradients over as they are, so the buffer only held a copy of every gradient. Without it ZeRO-3
            # keeps the bucket's gradients as autograd made them until the bucket is partitioned (the elements
            # the buffer held). tinyllama-1.1b, 2.75 GB budget, 2 interleaved pairs: peak RSS 3940 MiB against
            # 4020 (the buffer), backward 10.20 and 8.86 s against 8.49 and 9.24 (no change beyond the noise).
            self.contiguous_gradients = False
        if self.contiguous_gradients:
            for dtype, bucket in self.ipg_buckets.items():
                bucket.buffer = torch.empty(
                    self.reduce_bucket_size, dtype=dtype, device=get_accelerator().current_device_name()
                )
        self.grad_partitions_flat_buffer = None
        setattr(
            self,
            compat.STAGE3_GRAD_PARTITIONS,
            GradientPartitions(self.optimizer_swapper.gradients, self._aidaptiv_positions),
        )

    def _gradients_need_no_bucket(self) -> bool:
        """One rank reduces nothing, and on the CPU the gradients are host memory already."""
        return (
            get_accelerator().device_name() == "cpu"
            and dist.get_world_size(group=self.dp_process_group) == 1
            and not getattr(self, "zenflow", False)  # zenflow transposes gradients in that copy
        )

    def initialize_optimizer_states(self):
        if self._aidaptiv is None:
            return super().initialize_optimizer_states()
        # Nothing to do: the masters were written by initialize_parameters and the moments are zeros until
        # the first step (DeepSpeed swaps every sub-group in and out here, rewriting the parameters).

    # The step, sub-group by sub-group. ZeRO-3 calls, for each sub-group: _prepare_sub_group (swap in),
    # unscale_and_clip_grads, _optimizer_step, _reassign_or_swap_out_partitioned_parameters, and
    # _release_sub_group (swap out). We stream the sub-group through _optimizer_step instead, so the other
    # four only record the gradient scale or do nothing.
    def _prepare_sub_group(self, sub_group_id, timer_names):
        if self._aidaptiv is None:
            return super()._prepare_sub_group(sub_group_id, timer_names)

    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        if self._aidaptiv is None:
            return super().unscale_and_clip_grads(sub_group_id, total_norm)
        # Gradient clipping as ZeRO-3 defines it, applied chunk by chunk in _optimizer_step.
        combined_scale = self.loss_scale
        if self.clip_grad > 0.0:
            clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad  # the norm includes the loss scale
            combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
        self._aidaptiv_grad_scale = 1.0 / combined_scale

    def _optimizer_step(self, sub_group_id):
        runtime = self._aidaptiv
        if runtime is None:
            return super()._optimizer_step(sub_group_id)
        if sub_group_id != 0:
            return  # every sub-group was updated, as one pipeline, when ZeRO-3 asked for the first
        # The gradient scale is the same for all sub-groups (it comes from the global norm).
        scale = getattr(self, "_aidaptiv_grad_scale", None)
        self._aidaptiv_grad_scale = None

        def write_params(pieces, master):
            runtime.param_swapper.cache.write_pieces(
                [(p.record, p.start, p.numel, master[p.flat : p.flat + p.numel]) for p in pieces]
            )

        swapper = runtime.optimizer_swapper
        hyperparameters = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        swapper.streamed_step.begin(
            self.fp32_partitioned_groups_flat,
            scale,
            lambda i: DeepSpeedZeroOptimizer_Stage3._optimizer_step(self, i),
            write_params,
            hyperparameters,
            self.optimizer.param_groups,
            defer=swapper.master_is_parameter and runtime.cfg.deferred_update,
        )

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        if self._aidaptiv is None:
            return super()._reassign_or_swap_out_partitioned_parameters(sub_group_id)

    def _release_sub_group(self, sub_group_id, timer_names):
        if self._aidaptiv is None:
            return super()._release_sub_group(sub_group_id, timer_names)

    def reset_swap_buffers(self):
        # DeepSpeed calls this after copying its NVMe checkpoint folder back, to rebuild parameters from
        # the fp32 masters. Our checkpoint restores parameters and optimizer state byte for byte instead.
        if self._aidaptiv is None:
            return super().reset_swap_buffers()

    # ------------------------------------------------------------------ training
    def backward_prologue(self):
        if self._aidaptiv is not None:
            # Updates deferred from the last step that no forward fetched (unused parameters): the
            # gradient buffers are about to be filled again.
            self._aidaptiv.optimizer_swapper.streamed_step.flush()
            self._aidaptiv.phase = "backward"
            self._aidaptiv.release_heap()  # what the forward freed, before the backward's peak
        return super().backward_prologue()

    def backward_epilogue(self):
        out = super().backward_epilogue()
        if self._aidaptiv is not None:
            self._aidaptiv.phase = "forward"
            self._aidaptiv.release_heap()
        return out

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, communication_data_type):
        """ZeRO-3's reduce-scatter of a bucket's gradients (``__avg_scatter_grads``, name-mangled), which on a
        partition group of one rank concatenates the bucket into a new buffer and "reduce-scatters" it to
        itself: a copy of every gradient each step for nothing (about 0.25 s of tiny's step on 2 cores). With
        one rank the partitions are the gradients themselves, so they are handed over as they are (the same
        dtype conversions and scalings as DeepSpeed's, which are identities here but for dtype)."""
        group = self._get_param_partition_group(params_to_reduce[0]) if params_to_reduce else None
        if (
            self._aidaptiv is None
            or not params_to_reduce
            or dist.get_world_size(group=group) != 1
            or self.all2all_process_group is not None
        ):
            return super()._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params_to_reduce, communication_data_type)
        self._assert_same_partition_group(params_to_reduce)
        grads = [p.grad.view(-1) for p in params_to_reduce]
        if communication_data_type != self.dtype:
            grads = [g.to(communication_data_type) for g in grads]
        factor = self.gradient_predivide_factor
        if self.postscale_gradients and factor != 1.0:  # divided, then multiplied back (as DeepSpeed rounds)
            grads = [g.div(factor).mul(factor) for g in grads]
        averaging = self._gradient_averaging_world_size(params_to_reduce, 1)
        if averaging != 1:
            grads = [g.mul(1 / float(averaging)) for g in grads]
        if communication_data_type != self.gradient_accumulation_dtype:
            grads = [g.to(self.gradient_accumulation_dtype) for g in grads]
        return grads

    def _constant_buffered_norm2(self, input, buffer_size=250000000):
        if self._aidaptiv is None:
            return super()._constant_buffered_norm2(input, buffer_size)
        # Without DeepSpeed's fp64 copy of every partition (gradients.partition_norm says why).
        return partition_norm(input)

    def partition_grads(self, params_to_release, grad_partitions):
        runtime = self._aidaptiv
        if runtime is not None:
            # One block for the bucket's gradient buffers, opened before ZeRO-3 holds views of any of them
            # (see SubGroupGradients.open_bucket: opened one by one they fragmented the pool).
            # Parameters whose partition on this rank is empty are skipped by ZeRO-3 as by us.
            positions = self._aidaptiv_positions
            runtime.optimizer_swapper.gradients.open_bucket(
                [
                    positions[p.ds_id][0]
                    for p in params_to_release
                    if p.ds_id in positions and p.partition_numel() * self._get_param_partition_rank(p) < p.ds_numel
                ]
            )
        return super().partition_grads(params_to_release, grad_partitions)

    def step(self, closure=None):
        runtime = self._aidaptiv
        if runtime is None:
            return super().step(closure)
        t0 = time.perf_counter()
        wait0 = runtime.store.io_wait_s
        out = super().step(closure)
        runtime.optimizer_swapper.poll()
        runtime.param_swapper.cache.poll_writes()
        runtime.stats.optimizer_io_wait_s += runtime.store.io_wait_s - wait0
        # I/O wait of the whole training step: since the end of the previous step.
        runtime.stats.io_wait_steps.append(runtime.store.io_wait_s - getattr(self, "_aidaptiv_wait_mark", 0.0))
        self._aidaptiv_wait_mark = runtime.store.io_wait_s
        # Time applying updates since the last step: the previous step's deferred updates (applied in this
        # step's forward) and whatever this step applied at once.
        runtime.stats.apply_steps.append(runtime.stats.optimizer_apply_s - getattr(self, "_aidaptiv_apply_mark", 0.0))
        self._aidaptiv_apply_mark = runtime.stats.optimizer_apply_s
        # Of that, what was applied outside step() (the previous step's updates, in this step's forward).
        deferred = runtime.stats.optimizer_apply_deferred_s
        runtime.stats.deferred_apply_steps.append(deferred - getattr(self, "_aidaptiv_deferred_mark", 0.0))
        self._aidaptiv_deferred_mark = deferred
        runtime.stats.optimizer_s += time.perf_counter() - t0
        runtime.release_heap()
        runtime.pinned_bytes()
        # The next forward starts with the first groups: read them while the last writes finish.
        runtime.prefetcher.start_of_pass()
        return out
