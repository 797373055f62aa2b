"""The plans for a job on every backend, and the DeepSpeed config with the aidaptiv block a plan chose (what
``aidaptiv-ds plan --write-config`` writes)."""

from __future__ import annotations

from typing import Dict, List, Tuple

from aidaptiv_ds.common.sizes import GiB
from aidaptiv_ds.planner.memory import BACKENDS, BLOCK_LOSS_CHUNK_TOKENS, BackendPlan, Hardware, Job, plan_backend
from aidaptiv_ds.planner.predict import StepPrediction, predict
from aidaptiv_ds.planner.rates import Rates

# Assumed, not measured, when no GPU is here to measure: the CUDA context, cuBLAS/NCCL workspaces and the
# allocator's fragmentation on a GPU of the A100/H100 class. A given ``gpu_overhead`` replaces it.
GPU_OVERHEAD_ASSUMED = 1 * GiB


def parse_backends(text: str) -> List[str]:
    if text == "all":
        return list(BACKENDS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"`backend` {text!r}: expected all or a comma-separated list of {', '.join(BACKENDS)}")
    return names


def make_plans(
    job: Job, hw: Hardware, rates: Rates, backends: List[str]
) -> Tuple[List[BackendPlan], Dict[str, StepPrediction]]:
    plans = [plan_backend(b, job, hw) for b in backends]
    return plans, {p.backend: predict(p, p.job or job, hw, rates) for p in plans}


def aidaptiv_config(job: Job, plan: BackendPlan, nvme_path: str) -> dict:
    """A DeepSpeed config (ds_configs/aidaptiv.json's settings) with the aidaptiv block the plan chose."""
    st = plan.settings
    cfg = {
        "train_micro_batch_size_per_gpu": job.micro_batch,
        "gradient_accumulation_steps": job.grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000000,
        "optimizer": {"type": "AdamW", "params": {"lr": 7e-6, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
        "aidaptiv": {
            "enabled": True,
            "nvme_path": nvme_path,
            "host_memory_budget": st["host_memory_budget"],
            "layer_group_size": st["layer_group_size"],
            "prefetch_depth": st["prefetch_depth"],
        },
    }
    # The activations the plan counted, as the block's policy (so the written job holds what was planned).
    activations = {"policy": job.activations} if job.activations != "keep" else {}
    if job.loss_chunk_tokens and job.loss_chunk_tokens != BLOCK_LOSS_CHUNK_TOKENS:
        activations["loss_chunk_tokens"] = job.loss_chunk_tokens
    if activations:
        cfg["aidaptiv"]["activations"] = activations
    if job.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg
