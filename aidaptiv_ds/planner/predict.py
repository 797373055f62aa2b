"""Predicted step time and tokens/s: the bound of docs/DESIGN.md's performance model.

A step cannot be faster than the slowest resource it must use::

    max(compute, NVMe bytes / NVMe bandwidth, PCIe bytes / PCIe bandwidth, CPU Adam time)

- compute: ``6 x parameters x tokens`` FLOPs plus attention (``12 x layers x sequence x attention width``
  per token), at the measured matmul rate (the GPU's, or on CPU the node's shared by its ranks);
- NVMe: the bytes a step reads and writes per node (below, per backend) at the measured O_DIRECT rates; reads
  and writes share the disk, so their times add;
- PCIe (with a GPU, offloading backends): about 3 transfers of each weight per step (to the GPU for forward
  and backward, the gradient back);
- CPU Adam: parameters per rank at the node's measured Adam rate shared by its ranks (offloading backends,
  and every backend when training on CPU).
- ZeRO-3's own work on CPU (gathering and releasing every parameter, partitioning gradients): the model's
  parameters at the measured ``zero3_cpu`` rate, shared by the node's ranks; every rank gathers the whole
  model. Left out where the rate is unknown (and on GPUs, where it overlaps the GPU's compute).

Training on CPU, compute, Adam and ZeRO-3's own work run on the same cores one after the other, so their
sum is one bound ("cpu"). Collectives between ranks and DeepSpeed's other overheads are not modelled: the
prediction is a lower bound on step time (an upper bound on tokens/s), except that the ZeRO-3 term, measured
at one shape, makes the CPU figure an estimate. Scale: ``gpus x nodes`` ranks, each with its partition.

NVMe bytes per parameter of a rank's partition per step (e = bytes of the training dtype):

- zero_infinity: reads the weights twice (forward, backward), the fp32 master, both moments and the
  gradient; writes master, moments, gradient and weights;
- aidaptiv: reads the weights in forward and backward, except the groups its slots keep cached at the
  forward/backward turn and at the step boundary; non-resident optimizer sub-groups read and write their
  images and gradients; the updated weights are written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from aidaptiv_ds.planner.memory import (
    BackendPlan,
    Hardware,
    Job,
    partition_numels,
    step_flops,
)
from aidaptiv_ds.planner.rates import Rates


@dataclass
class StepPrediction:
    step_s: Optional[float]
    tokens_per_s: Optional[float]
    bound: Optional[str]
    times: Dict[str, float] = field(default_factory=dict)  # seconds per bound
    bytes: Dict[str, int] = field(default_factory=dict)  # per node per step
    missing: List[str] = field(default_factory=list)  # rates that were needed but unknown


def nvme_bytes(plan: BackendPlan, job: Job, hw: Hardware) -> Dict[str, float]:
    """(read, write) bytes of one rank's step."""
    e = job.elsize
    pr = sum(partition_numels(job.shape, hw.world))
    if plan.backend == "zero_infinity":
        return {"read": (2 * e + 4 + 8 + 4) * pr, "write": (4 + 8 + 4 + e) * pr}
    if plan.backend != "aidaptiv" or plan.split is None or not plan.split.fits:
        return {"read": 0.0, "write": 0.0}
    st = plan.settings
    cached = min(1.0, st["layer_group_slots"] / max(1, st["layer_groups"]))
    subs = plan.sub_group_numels
    resident = sum(subs[i] for i in plan.split.resident)
    streamed = 1.0 - (resident / sum(subs) if subs else 0.0)  # share of the elements not resident
    parts = 2 if job.dtype == "fp32" else 3
    # The slots' groups stay cached at both turns: the last ones of forward serve the start of backward, the
    # last ones of backward (the first layers) the start of the next forward.
    read = e * pr * 2 * (1 - cached) + streamed * (parts * 4 + 4) * pr
    write = e * pr + streamed * (parts * 4 + 4) * pr
    return {"read": read, "write": write}


def predict(plan: BackendPlan, job: Job, hw: Hardware, rates: Rates) -> StepPrediction:
    local = hw.gpus
    on_gpu = hw.gpu_mem is not None
    pr = sum(partition_numels(job.shape, hw.world))
    times: Dict[str, float] = {}
    missing: List[str] = []
    flops = step_flops(job)
    if on_gpu:
        if rates.gpu_flops:
            times["compute"] = flops / rates.gpu_flops
        else:
            missing.append("gpu_flops")
    elif rates.cpu_flops:
        times["compute"] = flops / (rates.cpu_flops / local)
    else:
        missing.append("cpu_flops")
    if not on_gpu or plan.backend != "zero3":
        if rates.cpu_adam:
            times["cpu_adam"] = pr / (rates.cpu_adam / local)
        else:
            missing.append("cpu_adam")
    io = nvme_bytes(plan, job, hw)
    node_bytes = {"nvme_read": int(io["read"] * local), "nvme_write": int(io["write"] * local)}
    if io["read"] or io["write"]:
        if rates.nvme_read and rates.nvme_write:
            times["nvme"] = node_bytes["nvme_read"] / rates.nvme_read + node_bytes["nvme_write"] / rates.nvme_write
        else:
            missing.append("nvme_read/nvme_write")
    if on_gpu and plan.backend != "zero3":
        node_bytes["pcie"] = int(3 * job.elsize * pr)  # per GPU: each GPU has its own link
        if rates.pcie:
            times["pcie"] = node_bytes["pcie"] / rates.pcie
        else:
            missing.append("pcie")
    if not on_gpu and "compute" in times and "cpu_adam" in times:
        # Same cores, one after the other; with ZeRO-3's own work per step where its rate is known (every rank
        # gathers the whole model: all parameters, on its share of the node's cores).
        name = "cpu (compute + Adam)"
        cpu = times.pop("compute") + times.pop("cpu_adam")
        if rates.zero3_cpu:
            name = "cpu (compute + Adam + ZeRO-3)"
            cpu += job.shape.num_parameters / (rates.zero3_cpu / local)
        times[name] = cpu
    if not times or missing:
        return StepPrediction(None, None, None, times, node_bytes, missing)
    bound = max(times, key=times.get)
    step = times[bound]
    tokens = job.tokens * job.grad_accum * hw.world
    return StepPrediction(step, tokens / step, bound, times, node_bytes, missing)
