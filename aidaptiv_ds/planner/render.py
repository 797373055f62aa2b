"""The plan as a table for people and as JSON for scripts."""

from __future__ import annotations

from typing import Dict, List, Optional

from aidaptiv_ds.common.sizes import GiB
from aidaptiv_ds.planner.memory import BackendPlan, Hardware, Job
from aidaptiv_ds.planner.predict import StepPrediction
from aidaptiv_ds.planner.rates import Rates


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GiB:.1f} GiB"


def _rate(name: str, value: float) -> str:
    if name in ("nvme_read", "nvme_write", "pcie"):
        return f"{value / 1e9:.2f} GB/s"
    if name.endswith("flops"):
        return f"{value / 1e12:.3f} TFLOP/s"
    if name in ("cpu_adam", "zero3_cpu"):
        return f"{value / 1e6:.0f} M params/s"
    return _gib(value)


def as_dict(
    job: Job, hw: Hardware, rates: Rates, plans: List[BackendPlan], predictions: Dict[str, StepPrediction]
) -> dict:
    s = job.shape
    out = {
        "model": s.name,
        "parameters": s.num_parameters,
        "active_parameters": s.active_parameters,
        "experts": None
        if not s.is_moe
        else {
            "routed_per_layer": s.experts,
            "per_token": s.experts_per_token,
            "moe_layers": len(s.moe_layers),
            "expert_parameters": s.expert_parameters,
        },
        "largest_layer_params": s.largest_layer_params,
        "job": {
            "seq_len": job.seq_len,
            "micro_batch": job.micro_batch,
            "grad_accum": job.grad_accum,
            "dtype": job.dtype,
            "activations": job.activations or "per backend",
        },
        "hardware": {
            "gpus_per_node": hw.gpus,
            "nodes": hw.nodes,
            "device": "cuda" if hw.gpu_mem is not None else "cpu",
            "gpu_mem_bytes": hw.gpu_mem,
            "host_mem_bytes": hw.host_mem,
            "nvme_free_bytes": hw.nvme_free,
            "framework_host_bytes": hw.framework_host,
            "launcher_host_bytes": hw.launcher_host,
            "gpu_overhead_bytes": hw.gpu_overhead,
        },
        "rates": rates.as_dict(),
        "io_tuning": rates.io or None,
        "backends": {},
    }
    for p in plans:
        pred = predictions.get(p.backend)
        out["backends"][p.backend] = {
            "fits": p.fits,
            "activations": (p.job or job).activations,
            "loss_chunk_tokens": (p.job or job).loss_chunk_tokens,
            "problems": p.problems,
            "notes": p.notes,
            "gpu_bytes_per_rank": p.gpu,
            "host_pinned_bytes_per_rank": p.host_pinned,
            "host_pageable_bytes_per_rank": p.host_pageable,
            "nvme_bytes_per_rank": p.nvme,
            "totals": {
                "gpu_per_rank": p.gpu_bytes,
                "host_per_rank": p.host_bytes,
                "host_pinned_per_rank": sum(p.host_pinned.values()),
                "host_per_node": p.host_bytes * hw.gpus,
                "nvme_per_node": p.nvme_bytes * hw.gpus,
            },
            "settings": p.settings or None,
            "deepspeed_estimate": p.deepspeed_estimate,
            "prediction": None
            if pred is None
            else {
                "step_s": pred.step_s,
                "tokens_per_s": pred.tokens_per_s,
                "bound": pred.bound,
                "times_s": pred.times,
                "bytes_per_node": pred.bytes,
                "missing_rates": pred.missing,
            },
        }
    return out


def moe_line(s) -> str:
    """What a mixture of experts is planned with (every expert) and what a token computes with (the active)."""
    return (
        f"mixture of experts: {s.active_parameters / 1e9:.2f}B of the {s.num_parameters / 1e9:.2f}B parameters active "
        f"per token ({s.experts_per_token} of {s.experts} experts in each of {len(s.moe_layers)} MoE layers); "
        "memory is planned for all of them (every expert is trained: its weights, gradients and optimizer state), "
        "compute for the active"
    )


def table(
    job: Job, hw: Hardware, rates: Rates, plans: List[BackendPlan], predictions: Dict[str, StepPrediction]
) -> str:
    s = job.shape
    lines = [
        f"model {s.name}: {s.num_parameters / 1e9:.2f}B parameters ({s.layers} layers, hidden {s.hidden}), "
        f"{job.dtype}, micro-batch {job.micro_batch} x sequence {job.seq_len}"
        + (f" x {job.grad_accum} accumulation steps" if job.grad_accum > 1 else "")
        + (
            f", activations {job.activations}"
            if job.activations
            else ", activations: each backend's first mode that fits (its notes say which)"
        ),
        f"hardware: {hw.gpus} {'GPU' if hw.gpu_mem is not None else 'CPU rank'}(s) per node x {hw.nodes} node(s); "
        + (f"GPU {_gib(hw.gpu_mem)} each; " if hw.gpu_mem is not None else "training on CPU; ")
        + f"host {_gib(hw.host_mem)} per node; NVMe "
        + (f"{_gib(hw.nvme_free)} free" if hw.nvme_free is not None else "not given"),
        "rates: "
        + ("; ".join(f"{n} {_rate(n, v['value'])} ({v['source']})" for n, v in rates.as_dict().items()) or "none"),
    ]
    if s.is_moe:
        lines.insert(1, moe_line(s))
    if rates.io:
        lines.append(
            f"I/O tuned for the swap disk: block_size {rates.io['block_size'] // 1024} KiB, queue_depth "
            f"{rates.io['queue_depth']} ({rates.io['when']}); aidaptiv uses them where its block leaves "
            "them 'auto'"
        )
    lines.append("")
    head = ("backend", "fits", "GPU/rank", "host/node", "pinned/node", "NVMe/node", "step s", "tokens/s", "bound")
    rows = [head]
    for p in plans:
        pred = predictions.get(p.backend)
        rows.append(
            (
                p.backend,
                "yes" if p.fits else "NO",
                _gib(p.gpu_bytes) if hw.gpu_mem is not None else "-",
                _gib(p.host_bytes * hw.gpus),
                _gib(sum(p.host_pinned.values()) * hw.gpus),
                _gib(p.nvme_bytes * hw.gpus) if p.nvme else "-",
                f"{pred.step_s:.3g}" if p.fits and pred and pred.step_s else "-",
                f"{pred.tokens_per_s:,.0f}" if p.fits and pred and pred.tokens_per_s else "-",
                (
                    "-"
                    if not p.fits
                    else pred.bound
                    if pred and pred.bound
                    else ("rates unknown: " + ", ".join(pred.missing) if pred and pred.missing else "-")
                ),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i in (0, 1, 8) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.append("")
    for p in plans:
        lines.append(f"{p.backend}:")
        for problem in p.problems:
            lines.append(f"  does not fit: {problem}")
        for where, items in (
            ("GPU", p.gpu),
            ("host pinned", p.host_pinned),
            ("host pageable", p.host_pageable),
            ("NVMe", p.nvme),
        ):
            if items:
                lines.append(f"  {where} per rank: " + ", ".join(f"{k} {_gib(v)}" for k, v in items.items()))
        if p.settings:
            lines.append(
                "  settings: "
                + ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in p.settings.items())
            )
        for note in p.notes:
            lines.append(f"  note: {note}")
    lines.append("")
    lines.append(
        "Step time: max(compute, NVMe, PCIe, CPU Adam) with the rates above (given, or this machine's), a lower "
        "bound; on CPU the measured ZeRO-3 work per step is added to compute and Adam, which makes it an "
        "estimate (how close it comes: bench/results/plan_accuracy/cpu_sweeps/summary.md). Collectives "
        "and other framework overheads are not modelled."
    )
    return "\n".join(lines)
