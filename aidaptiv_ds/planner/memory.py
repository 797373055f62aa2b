"""Bytes a training job needs, per backend, on the GPU, in host memory (pinned and pageable) and on NVMe.

Per parameter, ZeRO-3 with Adam keeps its weight (2 bytes in bf16, 4 in fp32), an fp32 gradient partition,
an fp32 master copy and two fp32 moments: 18 bytes in bf16 (DeepSpeed's estimator's figure), 20 in fp32
(ZeRO-3 keeps its fp32 copy even then). Each backend puts them somewhere else:

- ``zero3``: everything on the device (the GPU, or host memory when training on CPU);
- ``zero3_cpu_offload``: weights and optimizer state in pinned host memory, and a second fp32 copy of the
  gradients (the sub-groups' own gradient buffers);
- ``zero_infinity``: weights and optimizer state on NVMe; host holds DeepSpeed's pinned swap buffers
  (``buffer_count x buffer_size`` for parameters, ``buffer_count x`` the largest sub-group for the
  optimizer) and the fp32 gradient partitions;
- ``aidaptiv``: weights, optimizer images and gradients on NVMe; host holds the pinned pool, sized by the
  same arithmetic the swapper runs (:mod:`aidaptiv_ds.swap.budget_split`).

DeepSpeed's own buffers are counted as DeepSpeed 0.19 allocates them (runtime/zero/stage3.py): the reduce
bucket (``reduce_bucket_size`` elements of the training dtype; on CPU only the part gradients pass through is
ever touched), and, for ZeRO-Infinity, the fp32 gradient buffer of the largest optimizer sub-group that
``initialize_optimizer_states`` makes and keeps (ZeRO-3 and CPU offload free theirs after start-up, before
activations exist, so it is not counted for them).

Model-state bytes of DeepSpeed's backends agree with DeepSpeed's own estimator
(``estimate_zero3_model_states_mem_needs``, reproduced in :func:`aidaptiv_ds.planner.deepspeed_estimate.deepspeed_estimate`; a test compares them).
Activations are counted per token and layer, approximately (:func:`activation_bytes`); the framework's own
host memory (torch, DeepSpeed, transformers, the process group) is measured once (:mod:`.rates`).
All figures are bytes per rank unless a name says per node. Nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from aidaptiv_ds.common.sizes import SWAP_FILE_GROW_STEP, GiB, align_up, dtype_bytes
from aidaptiv_ds.config.settings import auto_chunk
from aidaptiv_ds.planner.deepspeed_estimate import ADDITIONAL_BUFFER_FACTOR, deepspeed_estimate
from aidaptiv_ds.planner.shapes import ModelShape
from aidaptiv_ds.swap.budget_split import BudgetSplit, fit_prefetch_depth, shrink_layer_groups, split_budget

BACKENDS = ("zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv")
# The block's words (aidaptiv.activations.policy): one vocabulary for the planner and the block.
ACTIVATION_POLICIES = ("keep", "recompute", "nvme")
# The activation modes each backend really has, most memory first: stock DeepSpeed keeps what autograd saves or
# recomputes through the model's gradient checkpointing; only aidaptiv's activations policy also stores layer
# inputs on NVMe (its policy "auto" keeps what fits and stores or recomputes the rest).
STOCK_ACTIVATIONS = ("keep", "recompute")
BACKEND_ACTIVATIONS = {"aidaptiv": ACTIVATION_POLICIES}
# The block's default aidaptiv.activations.loss_chunk_tokens (config.schema.ActivationsConfig): a job on the
# aidaptiv backend computes its loss in chunks of this many tokens unless its config says otherwise.
BLOCK_LOSS_CHUNK_TOKENS = 1024
# aidaptiv's "nvme" policy reads stored layer inputs back this many ahead of the backward (the block's
# activations.read_ahead default): those, and the one being used, are what memory holds of them.
NVME_ACTIVATIONS_IN_FLIGHT = 3

# DeepSpeed's defaults and our shipped ds_configs/ (zero_infinity.json), which the plan assumes.
REDUCE_BUCKET_SIZE = 500_000_000  # reduce_bucket_size (elements), not set by the shipped configs
SUB_GROUP_SIZE = 1_000_000_000  # sub_group_size: DeepSpeed's default (zero3, zero3_cpu_offload)
ZI_PARAM_BUFFER_COUNT = 5
ZI_PARAM_BUFFER_SIZE = 20_000_000
ZI_OPT_BUFFER_COUNT = 4
ZI_SUB_GROUP_SIZE = 100_000_000
# What a chosen host budget leaves of a node's memory for the OS, the page cache, data loading and the user:
# a tenth of it, at least 2 GiB. Only the plan's own choice keeps it (a budget given is taken as given), and
# never at the price of a job that would otherwise fit: then the budget is the least the run needs.
HOST_RESERVE_FRACTION = 0.1
HOST_RESERVE_MIN = 2 * GiB
# The transient above the steady state in a DeepSpeed backend's first steps on CPU, in host bytes per parameter
# of the whole (unpartitioned) model: every rank computes the gradients of the gathered layers, and the
# optimizer's first step allocates its work buffers. Measured, not fitted: a 1-rank run of the tiny preset
# (57.8M parameters, fp32) under ds_configs/zero3.json, RSS sampled every 0.3 s from /proc/PID/status:
#   aidaptiv-ds train --config ds_configs/zero3.json --model tiny --seq-len 64 --steps 3 --warmup 1
# peaked at 2426 MiB against a steady 1856 MiB after the first step: 570 MiB / 57.8M = 10.3 B per parameter.
# Its parts (autograd's gradients, the optimizer's buffers) are not separated yet; on a GPU these live in GPU
# memory and are bounded by the reduce bucket, so the term is counted only when training on CPU.
DS_STEP_TRANSIENT_PER_PARAM = 10.3
# aidaptiv has no such term: it fixes glibc's mmap threshold (aidaptiv.malloc_mmap_threshold, 1 MiB shipped;
# common/malloc_threshold.py), so freed gradients go back to the system. Before it did, a 1-rank tiny run
# (train --config ds_configs/aidaptiv.json --model tiny --seq-len 64 --micro-batch 2 --host-budget 290000000)
# peaked 413 MiB (7.5 B per parameter) above its steady state, nearly all freed memory the heap kept; a term
# fitted on that made plan say qwen2.5-3b needed 28.7 GiB where it peaked at 7.2 GiB. With the threshold the
# same tiny cell peaked at 850 MiB (the plan without a term: 854), and the 1-rank cells from 58M to 3.09B
# parameters (bench/results/cpu_small/epyc_aidaptiv_heap, bench/results/capacity_models/cap_8gib) within 3% of the plan; what
# a step holds above the steady state fits in the terms counted on their own (the gathered largest layer, the
# reduce bucket). A run with the threshold set to 0 peaks higher than planned.
# With more than one rank on CPU, gathering a parameter allocates its whole (unpartitioned) tensor: the
# all-gather output (on one rank the partition is the parameter and nothing is allocated). Measured on the tiny
# preset (fp32), ds_configs/zero3.json, 2 ranks under the deepspeed launcher, live tensors listed through gc and
# glibc's heap read with mallinfo2 at each phase: once the first step has recorded the trace, every parameter of
# the model is gathered (AVAILABLE) at the end of the forward, 220 MiB of all-gather outputs (the heap's bytes in
# use 435 MiB there, against 213 MiB on 1 rank). DeepSpeed bounds them by stage3_max_live_parameters. They are
# below glibc's largest dynamic mmap threshold (32 MiB), so they come from the heap, and the heap keeps what they
# took after their release (the peak RSS of that run fell from 2323 to 1690 MiB with MALLOC_MMAP_THRESHOLD_
# fixed at 128 KiB; 1 rank: 2517 to 2210): at the peak they are resident whether or not still in use.
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's default; the shipped configs do not set it


@dataclass
class Hardware:
    """What one node offers. ``gpu_mem`` None means training on the CPU (the device is host memory)."""

    gpus: int = 1  # ranks per node (GPUs, or processes on CPU)
    nodes: int = 1
    gpu_mem: Optional[int] = None  # bytes per GPU
    host_mem: int = 0  # bytes per node
    nvme_free: Optional[int] = None  # bytes free in the swap directory, per node; None: not checked
    framework_host: int = 0  # host bytes per rank of torch/DeepSpeed/transformers themselves
    launcher_host: int = 0  # host bytes per node of the deepspeed launcher's own processes
    # (its runner and launch.py) when the job runs under it; 0: started directly
    gpu_overhead: int = 0  # GPU bytes per rank outside tensors (CUDA context, workspaces)

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


@dataclass
class Job:
    shape: ModelShape
    seq_len: int
    micro_batch: int
    grad_accum: int = 1
    dtype: str = "bf16"
    activations: Optional[str] = "keep"
    """keep, recompute (layer inputs kept, one layer recomputed at a time) or nvme (recompute with the layer
    inputs on NVMe: aidaptiv's activations policy "nvme", and the least "auto" can hold). None: each backend is
    planned with the first of its own modes that fits (:func:`plan_job`)."""
    loss_chunk_tokens: Optional[int] = None
    """Tokens per chunk of the LM head and loss (aidaptiv.activations.loss_chunk_tokens); None: unchunked, or
    with ``activations`` None the block's default for aidaptiv."""
    # aidaptiv: None chooses the largest budget host memory allows
    host_budget: Optional[int] = None  # bytes per rank
    layer_group_size: int = 4
    prefetch_depth: int = 1
    chunk_numel: Optional[int] = None  # None: 'auto' (sized from the budget, as the block does)
    cache_optimizer_state: bool = True

    @property
    def elsize(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def tokens(self) -> int:
        """Tokens per rank per micro-step."""
        return self.micro_batch * self.seq_len


@dataclass
class BackendPlan:
    backend: str
    gpu: Dict[str, int] = field(default_factory=dict)  # per rank (empty when training on CPU)
    host_pinned: Dict[str, int] = field(default_factory=dict)  # per rank
    host_pageable: Dict[str, int] = field(default_factory=dict)  # per rank
    nvme: Dict[str, int] = field(default_factory=dict)  # per rank
    problems: List[str] = field(default_factory=list)  # why it does not fit (empty: it fits)
    notes: List[str] = field(default_factory=list)
    settings: Dict[str, object] = field(default_factory=dict)  # aidaptiv: the block that makes it fit
    split: Optional[BudgetSplit] = None
    sub_group_numels: List[int] = field(default_factory=list)  # aidaptiv: this rank's optimizer sub-groups
    deepspeed_estimate: Optional[Dict[str, int]] = None
    job: Optional[Job] = None  # the job as planned (its activation mode chosen, with activations None)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def host_bytes(self) -> int:
        """Host memory of one rank: pinned and pageable."""
        return sum(self.host_pinned.values()) + sum(self.host_pageable.values())

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu.values())

    @property
    def nvme_bytes(self) -> int:
        return sum(self.nvme.values())


def partition_numels(shape: ModelShape, world: int) -> List[int]:
    """Elements of this rank's partition of every parameter (ZeRO-3 pads each to a multiple of the ranks)."""
    return [-(-n // world) for n in shape.parameter_numels()]


def activation_bytes(job: Job) -> Dict[str, int]:
    """Activations one rank holds at the end of the forward, approximately (keep it simple):

    per token and layer, the tensors autograd saves in a Llama layer: about 10 hidden-sized vectors
    (norm inputs and outputs, q/k/v/attention output, residuals) and 4 MLP-sized ones (gate, up, their
    product, the activation) in the training dtype, plus 2 hidden-sized fp32 copies inside RMSNorm; the
    logits with their fp32 copy and the loss's log-softmax. Attention scores are not counted (SDPA's flash
    and memory-efficient kernels, on CPU too, do not keep them). ``recompute`` keeps only each layer's
    input and recomputes one layer at a time; ``nvme`` keeps only the inputs read back ahead of the backward.
    With ``loss_chunk_tokens`` the logits of one chunk exist at a time.

    A mixture-of-experts layer sends each token to ``experts_per_token`` experts: per token, that many
    expert-sized sets of 4 (instead of the dense MLP's), plus the token's copy gathered for each expert and its
    weighted output, and the router's logits and probabilities over every expert in fp32."""
    s, e, t = job.shape, job.elsize, job.tokens
    dense_layer = t * ((10 * s.hidden + 4 * s.intermediate) * e + 2 * s.hidden * 4)
    moe_layer = t * (
        (10 * s.hidden + s.experts_per_token * (4 * s.expert_intermediate + 2 * s.hidden)) * e
        + 2 * s.hidden * 4
        + 2 * s.experts * 4
    )
    sparse = len(s.moe_layers)
    layers = (s.layers - sparse) * dense_layer + sparse * moe_layer
    per_layer = max([dense_layer] * (s.layers > sparse) + [moe_layer] * (sparse > 0))
    rows = min(t, job.loss_chunk_tokens) if job.loss_chunk_tokens else t
    logits = rows * s.vocab * (e + 4 + 4)
    if job.activations == "recompute":
        return {
            "layer inputs (checkpointed)": s.layers * t * s.hidden * e,
            "one layer recomputed": per_layer,
            "logits and loss": logits,
        }
    if job.activations == "nvme":
        return {
            "layer inputs (on NVMe, read ahead)": min(s.layers, NVME_ACTIVATIONS_IN_FLIGHT) * t * s.hidden * e,
            "one layer recomputed": per_layer,
            "logits and loss": logits,
        }
    return {"layers": layers, "logits and loss": logits}


def _state(pr: int, e: int) -> Dict[str, int]:
    return {
        "weights": e * pr,
        "gradients (fp32)": 4 * pr,
        "optimizer: fp32 master": 4 * pr,
        "optimizer: Adam moments": 8 * pr,
    }


def _device(plan: BackendPlan, hw: Hardware, items: Dict[str, int]) -> None:
    """Put what lives on the device on the GPU, or in pageable host memory when training on CPU."""
    target = plan.gpu if hw.gpu_mem is not None else plan.host_pageable
    for k, v in items.items():
        target[k] = target.get(k, 0) + v


def _common(plan: BackendPlan, job: Job, hw: Hardware) -> None:
    plan.host_pageable["framework (torch, DeepSpeed, transformers)"] = hw.framework_host
    _device(plan, hw, {f"activations ({job.activations})": sum(activation_bytes(job).values())})
    if hw.gpu_mem is not None:
        plan.gpu["CUDA context and workspaces"] = hw.gpu_overhead


def plan_deepspeed(backend: str, job: Job, hw: Hardware) -> BackendPlan:
    """zero3, zero3_cpu_offload or zero_infinity as our ds_configs/ run them."""
    s, e = job.shape, job.elsize
    pr = sum(partition_numels(s, hw.world))
    plan = BackendPlan(backend)
    gathered = 4 * s.largest_layer_params  # the estimator's largest_layer_memory
    gathered_key = "gathered largest layer"
    if hw.gpu_mem is None and hw.world > 1:
        # every rank's all-gather outputs of the whole model at once (:data:`STAGE3_MAX_LIVE_PARAMETERS`)
        gathered = e * min(s.num_parameters, STAGE3_MAX_LIVE_PARAMETERS)
        gathered_key = "gathered parameters (all-gather outputs of the whole model, held by the heap)"
    offload = backend != "zero3"
    cpu, gpu, _ = deepspeed_estimate(
        s.num_parameters, s.largest_layer_params, hw.gpus, hw.nodes, cpu_offload=offload, cpu_offload_params=offload
    )
    plan.deepspeed_estimate = {"cpu_per_node": cpu, "gpu_per_gpu": gpu}
    # The reduce bucket: on a GPU allocated whole; on CPU only what the gradients passing through touch.
    bucket = REDUCE_BUCKET_SIZE if hw.gpu_mem is not None else min(REDUCE_BUCKET_SIZE, s.num_parameters)
    buffers = {"reduce bucket": bucket * e}
    if backend == "zero3":
        _device(plan, hw, {**_state(pr, e), gathered_key: gathered, **buffers})
        # zero.Init builds one layer at a time in host memory before partitioning it (the estimator's cpu_mem)
        plan.host_pageable["model build: largest layer x 1.5"] = int(
            4 * s.largest_layer_params * ADDITIONAL_BUFFER_FACTOR
        )
    elif backend == "zero3_cpu_offload":
        _device(plan, hw, {gathered_key: gathered, **buffers})
        plan.host_pinned.update(_state(pr, e))
        plan.host_pinned["sub-group gradient buffers (fp32)"] = 4 * pr
    else:
        _device(plan, hw, {gathered_key: gathered, **buffers})
        plan.nvme.update(
            {
                "weights": e * pr,
                "optimizer: fp32 master": 4 * pr,
                "optimizer: Adam moments": 8 * pr,
                "gradients (fp32, swapped with the optimizer)": 4 * pr,
            }
        )
        plan.host_pinned["parameter swap buffers"] = ZI_PARAM_BUFFER_COUNT * ZI_PARAM_BUFFER_SIZE * e
        largest_sub = max(_sub_groups(partition_numels(s, hw.world), ZI_SUB_GROUP_SIZE))
        plan.host_pinned["optimizer swap buffers"] = ZI_OPT_BUFFER_COUNT * largest_sub * 4
        plan.host_pageable["gradients (fp32)"] = 4 * pr
        plan.host_pageable["optimizer-init gradient buffer (fp32)"] = 4 * largest_sub
    _common(plan, job, hw)
    if hw.gpu_mem is None:
        plan.host_pageable["first-step transient (gradients of the gathered model, optimizer buffers)"] = (
            step_transient_bytes(job.shape.num_parameters)
        )
    return plan


def step_transient_bytes(num_parameters: int) -> int:
    """Host bytes a rank of DeepSpeed's backends holds above its steady state in its steps on CPU
    (:data:`DS_STEP_TRANSIENT_PER_PARAM`, measured): of the whole model, as every rank gathers every layer."""
    return int(DS_STEP_TRANSIENT_PER_PARAM * num_parameters)


def _sub_groups(part_numels: List[int], sub_group_size: int) -> List[int]:
    """DeepSpeed's optimizer sub-groups over the partitions, in order (stage3 _create_fp16_sub_groups)."""
    total = sum(part_numels)
    if sub_group_size >= total:
        return [total]
    out, size = [], 0
    for i, n in enumerate(part_numels):
        size += n
        if size >= sub_group_size or i == len(part_numels) - 1:
            out.append(size)
            size = 0
    return out


def _layer_group_bytes(shape: ModelShape, world: int, elsize: int, layer_group_size: int) -> List[int]:
    """Bytes of each layer group of one rank: the embeddings, ``layer_group_size`` layers at a time, and
    what follows the layers; each partition in its own 4 KiB-aligned extent (as zero3/plan.py counts them)."""
    groups = shape.groups()
    ext = lambda numels: sum(align_up(-(-n // world) * elsize) for n in numels)
    layers = groups[1:-1]
    out = [ext(groups[0][1])]
    for i in range(0, len(layers), layer_group_size):
        out.append(sum(ext(numels) for _, numels in layers[i : i + layer_group_size]))
    return out + [ext(groups[-1][1])]


def gathered_groups_bytes(shape: ModelShape, elsize: int, layer_group_size: int, prefetch_depth: int) -> int:
    """Bytes of the unpartitioned parameters of ``1 + prefetch_depth`` consecutive layer groups (the
    embeddings, ``layer_group_size`` layers at a time, what follows the layers), the largest such run."""
    groups = _layer_group_bytes(shape, 1, elsize, layer_group_size)
    n = min(len(groups), 1 + prefetch_depth)
    return max(sum(groups[i : i + n]) for i in range(len(groups) - n + 1))


def aidaptiv_split(job: Job, hw: Hardware, budget: int):
    """(split, layer_group_size, group bytes, sub-group numels, chunk) for a budget of this rank, as
    zero3/plan.py's plan_run computes them for the built model."""
    parts_n = partition_numels(job.shape, hw.world)
    chunk = job.chunk_numel or auto_chunk(budget)
    subs = _sub_groups(parts_n, chunk)  # our config sets DeepSpeed's sub_group_size to the chunk
    size, group_bytes = shrink_layer_groups(
        job.layer_group_size,
        job.prefetch_depth,
        budget,
        lambda n: _layer_group_bytes(job.shape, hw.world, job.elsize, n),
    )
    parts = 2 if job.dtype == "fp32" else 3  # chunk image parts (fp32: the parameter is the master)
    split = fit_prefetch_depth(
        job.prefetch_depth,
        lambda depth: split_budget(
            budget, group_bytes, subs, chunk, job.elsize, parts, depth, job.cache_optimizer_state
        ),
    )
    return split, size, group_bytes, subs, chunk


def aidaptiv_reduce_bucket(budget: int, on_host: bool) -> int:
    """Elements of DeepSpeed's reduce bucket under aidaptiv: what config.to_deepspeed_config makes of the shipped
    configs' default (a test compares the two)."""
    from aidaptiv_ds.config.translate import reduce_bucket_cap

    return min(REDUCE_BUCKET_SIZE, reduce_bucket_cap(budget, on_host))


def plan_aidaptiv(job: Job, hw: Hardware) -> BackendPlan:
    s, e = job.shape, job.elsize
    plan = BackendPlan("aidaptiv")
    if hw.gpu_mem is None and hw.world > 1:
        # With more than one rank a gathered layer group is a new, whole tensor per parameter (the all-gather
        # output; on one rank the pool's slot is the parameter), for the group in use and those prefetched: in a
        # 2-rank run of the tiny preset these, from the heap, took the transient above its 1-rank figure by
        # 190 MiB (1305 MiB peak against 602 after start-up, 138 MiB pool), and the gathered parameters live
        # at the start of the backward were whole tensors outside the pool (gc).
        _device(
            plan,
            hw,
            {
                "gathered layer groups (all-gather outputs, current and prefetched)": gathered_groups_bytes(
                    s, e, job.layer_group_size, job.prefetch_depth
                )
            },
        )
    else:
        _device(plan, hw, {"gathered largest layer": 4 * s.largest_layer_params})
    _common(plan, job, hw)
    # DeepSpeed's reduce bucket, capped by the budget (on CPU only what the gradients touch, in host memory).
    bucket_bytes = lambda b: (
        (
            aidaptiv_reduce_bucket(b, False)
            if hw.gpu_mem is not None
            else min(aidaptiv_reduce_bucket(b, True), s.num_parameters)
        )
        * e
    )
    local = hw.gpus
    pageable = sum(plan.host_pageable.values())
    available = (hw.host_mem - hw.launcher_host) // local - pageable
    budget = job.host_budget
    if budget is None:
        # The largest budget host memory allows less the reserve, but no more than the run can use (everything
        # resident).
        on_host = lambda b: b + (bucket_bytes(b) if hw.gpu_mem is None else 0)
        reserve = int(max(HOST_RESERVE_MIN, HOST_RESERVE_FRACTION * hw.host_mem)) // local
        budget = max(available - reserve, 1)
        least = aidaptiv_split(job, hw, max(available, 1))[0]
        if least.fits and not aidaptiv_split(job, hw, budget)[0].fits:
            budget = least.minimum  # the reserve would refuse a job that fits: it gets the least it needs
            plan.notes.append(
                f"host_memory_budget: less than the {reserve / GiB:.1f} GiB reserve is left for the OS and the "
                "page cache"
            )
        for _ in range(3):  # the 'auto' chunk depends on the budget, and what the run can use on the chunk
            split = aidaptiv_split(job, hw, max(budget, 1))[0]
            if not split.fits:
                break
            budget = min(budget, split.pool)
        while budget > 1 and on_host(budget) > available:
            budget = max(1, available - (on_host(budget) - budget))
        plan.notes.append(
            "host_memory_budget chosen: the host memory left after the framework"
            + (" and activations" if hw.gpu_mem is None else "")
            + f" and a reserve of {reserve / GiB:.1f} GiB for the OS and the page cache, at most what the model"
            " can use"
        )
    split, size, group_bytes, subs, chunk = aidaptiv_split(job, hw, budget)
    plan.split = split
    plan.sub_group_numels = subs
    _device(plan, hw, {"reduce bucket": bucket_bytes(budget)})
    parts = 2 if job.dtype == "fp32" else 3
    pr = sum(partition_numels(s, hw.world))
    weights, optimizer = sum(group_bytes), (parts + 1) * 4 * pr  # optim.swp: the images and the gradients
    plan.nvme.update(
        {
            "weights (4 KiB-aligned partitions)": weights,
            "optimizer images" + (" (moments)" if parts == 2 else " (master, moments)"): parts * 4 * pr,
            "gradients (fp32)": 4 * pr,
        }
    )
    stored = job.shape.layers * job.tokens * job.shape.hidden * job.elsize if job.activations == "nvme" else 0
    if stored:
        plan.nvme["activations (every layer's input, on NVMe)"] = stored
    # Each swap file is allocated in whole growth steps; activations.swp exists with the nvme policy and with
    # "auto", whose bandwidth probe writes into it (counted: a plan cannot tell "auto" from a policy it chose).
    step = SWAP_FILE_GROW_STEP
    activations_file = align_up(stored, step) - stored if stored else step  # auto's probe: one whole step
    growth = sum(align_up(b, step) - b for b in (weights, optimizer)) + activations_file
    plan.nvme[f"swap files' growth ({step // 2**20} MiB steps)"] = growth
    plan.host_pinned["pinned pool (layer-group slots, resident optimizer state, staging)"] = (
        split.pool if split.fits else split.minimum
    )
    plan.settings = {
        "host_memory_budget": int(budget),
        "layer_group_size": size,
        "prefetch_depth": split.prefetch_depth,
        "optimizer_chunk_numel": int(chunk),
        "resident_sub_groups": len(split.resident),
        "sub_groups": len(subs),
        "layer_group_slots": split.slots,
        "layer_groups": len(group_bytes),
        "activations": job.activations,
    }
    if not split.fits:
        if job.host_budget is None:
            left = "the framework" + (" and activations" if hw.gpu_mem is None else "")
            plan.problems.append(
                f"host memory: {max(0, available) / GiB:.1f} GiB per rank is left for aidaptiv's host budget after "
                f"{left}, but the swapper needs at least {split.minimum / GiB:.1f} GiB ({split.min_slots} layer-group "
                f"slots of {split.slot / GiB:.2f} GiB, {split.general / GiB:.2f} GiB for a gradient and optimizer "
                "chunks): more host memory, more ranks (smaller partitions), or a smaller `layer_group_size` or "
                "`prefetch_depth`"
            )
        else:
            plan.problems.append(split.shortfall())
    return plan


def check(plan: BackendPlan, hw: Hardware) -> BackendPlan:
    """Compare what the plan needs with what the hardware has; every shortfall becomes a problem."""
    local = hw.gpus
    if hw.gpu_mem is not None and plan.gpu_bytes > hw.gpu_mem:
        top = max(plan.gpu, key=plan.gpu.get)
        plan.problems.append(
            f"GPU memory: needs {plan.gpu_bytes / GiB:.1f} GiB per GPU but has "
            f"{hw.gpu_mem / GiB:.1f} GiB (largest: {top}, {plan.gpu[top] / GiB:.1f} GiB)"
        )
    host = plan.host_bytes * local + hw.launcher_host
    if host > hw.host_mem:
        items = {**plan.host_pinned, **plan.host_pageable}
        top = max(items, key=items.get)
        launcher = f" + {hw.launcher_host / GiB:.1f} GiB for the launcher" if hw.launcher_host else ""
        plan.problems.append(
            f"host memory: needs {host / GiB:.1f} GiB per node ({local} rank(s) x "
            f"{plan.host_bytes / GiB:.1f} GiB{launcher}) but has {hw.host_mem / GiB:.1f} GiB (largest: {top}, "
            f"{items[top] / GiB:.1f} GiB per rank)"
        )
    if plan.nvme:
        nvme = plan.nvme_bytes * local
        if hw.nvme_free is None:
            plan.notes.append("NVMe space not checked: give `nvme_path` DIR (or `nvme_free` SIZE)")
        elif nvme > hw.nvme_free:
            plan.problems.append(
                f"NVMe space: needs {nvme / GiB:.1f} GiB per node but the swap directory has "
                f"{hw.nvme_free / GiB:.1f} GiB free"
            )
    return plan


def plan_backend(backend: str, job: Job, hw: Hardware) -> BackendPlan:
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown: choose one of {', '.join(BACKENDS)} or all")
    if job.activations is None:
        return plan_job(backend, job, hw)
    plan = plan_aidaptiv(job, hw) if backend == "aidaptiv" else plan_deepspeed(backend, job, hw)
    plan.job = job
    if job.activations not in activation_modes(backend):
        plan.problems.append(
            f"activations {job.activations}: {backend} has no such mode (stock DeepSpeed keeps activations or "
            "recomputes them with the model's gradient checkpointing; only aidaptiv's activations policy stores "
            "them on NVMe): plan it with `activations` keep or recompute, or leave `activations` out"
        )
    return check(plan, hw)


def activation_modes(backend: str) -> tuple:
    """The activation modes ``backend`` really has, most memory first."""
    return BACKEND_ACTIVATIONS.get(backend, STOCK_ACTIVATIONS)


def plan_job(backend: str, job: Job, hw: Hardware) -> BackendPlan:
    """``backend``'s plan with the first of its activation modes that fits (all of them tried when none does:
    the plan of the last, the least memory, with its problems), a note saying which. A job without a loss
    chunk gets the block's default on aidaptiv (what its run does) and none on stock DeepSpeed."""
    modes = activation_modes(backend)
    chunk = job.loss_chunk_tokens
    if chunk is None and backend == "aidaptiv":
        chunk = BLOCK_LOSS_CHUNK_TOKENS
    plan = None
    for mode in modes:
        plan = plan_backend(backend, replace(job, activations=mode, loss_chunk_tokens=chunk), hw)
        if plan.fits:
            break
    tried = modes[: modes.index(plan.job.activations)]
    if plan.fits:
        why = f" ({' and '.join(tried)} do{'es' if len(tried) == 1 else ''} not fit)" if tried else ""
        plan.notes.insert(0, f"activations: {plan.job.activations}{why}, of this backend's {', '.join(modes)}")
    else:
        plan.notes.insert(
            0, f"activations: none of this backend's {', '.join(modes)} fits; shown with {plan.job.activations}"
        )
    return plan


def step_flops(job: Job) -> float:
    """FLOPs of one rank's step: 6 x parameters x tokens (forward and backward) plus attention. A token of a
    mixture of experts computes with its active parameters only (``ModelShape.active_parameters``)."""
    s = job.shape
    tokens = job.tokens * job.grad_accum
    attention = 12 * s.layers * job.seq_len * s.heads * s.head_dim
    return float(tokens * (6 * s.active_parameters + attention))
