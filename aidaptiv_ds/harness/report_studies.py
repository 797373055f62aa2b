"""The report's sections that set our cells beside the published studies: Figure 8 of seeds/003, Table VI
with model FLOPs utilisation, the Signal65 configurations of seeds/000, and the sources cited."""

from __future__ import annotations

from typing import Optional

from aidaptiv_ds.harness import published
from aidaptiv_ds.harness.report_tables import (
    SHORT,
    _order_backends,
    cell_text,
    fmt_tps,
    md_table,
)
from aidaptiv_ds.models.presets import nominal_parameters


def figure8_section(rows: list[dict]) -> str:
    """Peak tokens/s over batch at sequence 256 for Llama 3.1 70B against Figure 8's peaks."""
    sel = [r for r in rows if r["model"] == "llama3.1-70b" and r["seq_len"] == 256 and r["status"] == "ok"]
    pts = [p for p in published.POINTS if p.source == "cdac-f8"]
    if not sel:
        return ""
    body = []
    for g in sorted({r["gpus"] for r in sel} | {p.gpus for p in pts}):
        line = [str(g)]
        for b in _order_backends(sel):
            best = max(
                (r for r in sel if r["backend"] == b and r["gpus"] == g),
                key=lambda r: r["tokens_per_s"] or 0,
                default=None,
            )
            line.append(f"{fmt_tps(best['tokens_per_s'])} (batch {best['micro_batch']})" if best else "")
        p = next((p for p in pts if p.gpus == g), None)
        line.append(f"{p.tokens_per_s:,}" + (f" (batch {p.micro_batch})" if p.micro_batch else "") if p else "")
        body.append(line)
    return "### Peak over batch, Llama 3.1 70B at sequence 256 (C-DAC Figure 8)\n\n" + md_table(
        ["GPUs"]
        + [SHORT.get(b, b) for b in _order_backends(sel)]
        + ["C-DAC F.8 aiDAPTIV+ (A100 40GB PCIe, published)"],
        body,
        right_from=1,
    )


# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's datasheets, matched on the GPU's name in
# order (the PCIe H100 before the SXM one). Only for the share-of-peak column; an unknown GPU shows none.
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0))


TABLE_VI_GPU = "NVIDIA A100 40GB PCIe"


def peak_tflops(gpu_name: str) -> Optional[float]:
    return next((v for k, v in PEAK_BF16_TFLOPS if k in (gpu_name or "")), None)


def _model_flops_text(tps: float, params: float, peak: Optional[float]) -> str:
    """Model FLOP/s of a throughput (6 x parameters x tokens/s: forward and backward of the weights, attention
    not counted) and its share of ``peak`` (the peak of all the GPUs that ran it)."""
    tf = 6 * params * tps / 1e12
    return f"{tf:.1f} TFLOP/s" + (f", {100 * tf / peak:.1f}% of peak" if peak else "")


def table_vi_flops_section(rows: list[dict]) -> str:
    """GPU cells against C-DAC Table VI at the same sequence lengths, in model FLOP/s: the published
    aiDAPTIV+ rows are Llama 2-7B / 3.1-8B on an A100 40GB, ours are whatever model the grid scaled to this
    GPU, so tokens/s cannot be compared but the share of the GPU's peak a streamed fine-tune keeps can."""
    gpu_rows = [
        r
        for r in rows
        if r["status"] == "ok"
        and r.get("tokens_per_s")
        and r.get("peak_gpu_mb")
        and (r.get("machine") or {}).get("gpus")
    ]
    pts = [p for p in published.POINTS if p.source == "cdac-t6" and p.status == "ok" and p.tokens_per_s]
    seqs = sorted({r["seq_len"] for r in gpu_rows} & {p.seq_len for p in pts})
    if not seqs:
        return ""
    gpu = gpu_rows[0]["machine"]["gpus"][0]["name"]
    peak, a100 = peak_tflops(gpu), peak_tflops(TABLE_VI_GPU)
    models = sorted({r["model"] for r in gpu_rows}, key=lambda m: (nominal_parameters(m) or 0, m))
    columns = [(m, b) for m in models for b in _order_backends([r for r in gpu_rows if r["model"] == m])]
    pub_models = sorted({p.model for p in pts}, key=lambda m: nominal_parameters(m) or 0)
    gpus = sorted({r["gpus"] for r in gpu_rows})
    body = []
    for g in gpus:
        for seq in seqs:
            line = [str(seq), str(g)]
            for m, b in columns:
                best = max(
                    (r for r in gpu_rows if (r["model"], r["backend"], r["seq_len"], r["gpus"]) == (m, b, seq, g)),
                    key=lambda r: r["tokens_per_s"],
                    default=None,
                )
                params = best and (best.get("params") or nominal_parameters(m))
                line.append(
                    f"{fmt_tps(best['tokens_per_s'])} (batch {best['micro_batch']}): "
                    f"{_model_flops_text(best['tokens_per_s'], params, peak and peak * g)}"
                    if best and params
                    else ""
                )
            for m in pub_models:
                best = max(
                    (p for p in pts if (p.model, p.seq_len, p.gpus) == (m, seq, g)),
                    key=lambda p: p.tokens_per_s,
                    default=None,
                )
                line.append(
                    f"{best.tokens_per_s:,.0f} (batch {best.micro_batch}): "
                    f"{_model_flops_text(best.tokens_per_s, nominal_parameters(m), a100 * g)}"
                    if best
                    else ""
                )
            body.append(line)
    header = (
        ["seq", "GPUs"]
        + [f"{m} {SHORT.get(b, b)}" for m, b in columns]
        + [f"C-DAC T.VI aiDAPTIV+ {m} ({TABLE_VI_GPU}, published)" for m in pub_models]
    )
    peak_text = f"{peak:g} TFLOP/s" if peak else "unknown (no share of peak shown)"
    return (
        "### Against C-DAC Table VI in model FLOP/s (best over batch per sequence)\n\n"
        f"Ours on {gpu} (dense bf16 peak {peak_text}); theirs on {TABLE_VI_GPU} ({a100:g} TFLOP/s), with the "
        "MiPhi aiDAPTIV+ kit. The models differ (a grid scales the model to the GPU cap so that the state is to "
        "the GPU what Llama 2-7B's is to an A100 40GB), so the comparable figure is the model FLOP/s, 6 x "
        "parameters x tokens/s (attention not counted: at sequence 2,048 it would add about 8% to Llama 2-7B's "
        "figure and more to a narrower model's, so leaving it out understates the smaller model's side), "
        "and its share of the peak of the GPUs that ran it.\n\n" + md_table(header, body, right_from=2)
    )


SIGNAL65_SAMPLES = 672


SIGNAL65_SEQ = 12000


def signal65_section(rows: list[dict]) -> str:
    pts = [p for p in published.POINTS if p.source == "signal65"]
    keys = {(p.model, p.seq_len, p.micro_batch, p.gpus) for p in pts}
    sel = [r for r in rows if (r["model"], r["seq_len"], r["micro_batch"], r["gpus"]) in keys]
    if not sel:
        return ""
    backends = _order_backends(sel)
    body = []
    for model, seq, mb, g in sorted(keys, key=lambda k: (nominal_parameters(k[0]) or 0, k[3])):
        ours = {
            r["backend"]: r
            for r in sel
            if (r["model"], r["seq_len"], r["micro_batch"], r["gpus"]) == (model, seq, mb, g)
        }
        if not ours:
            continue
        pub_ok = next(p for p in pts if p.model == model and p.gpus == g and p.status == "ok")
        line = [model, str(mb), str(g), f"done {pub_ok.completion}", "OOM"]
        for b in backends:
            r = ours.get(b)
            if r and r["status"] == "ok" and r["tokens_per_s"]:
                secs = SIGNAL65_SAMPLES * SIGNAL65_SEQ / r["tokens_per_s"]
                line.append(f"{fmt_tps(r['tokens_per_s'])} tok/s; {secs / 3600:.1f} h")
            else:
                line.append(cell_text(r))
        body.append(line)
    return (
        "### Signal65 configurations (sequence 12,000, gradient accumulation 10)\n\n"
        "Published: aiDAPTIV+ completion time of one epoch (672 samples) and Axolotl's out-of-memory, on "
        "RTX 6000 Ada 48 GB. Ours: tokens/s, and the time 672 full 12,000-token sequences would take at that "
        "rate; their samples were likely shorter, so that time is an upper bound, not a like-for-like "
        "figure.\n\n"
        + md_table(
            ["model", "batch", "GPUs", "Signal65 aiDAPTIV+", "Signal65 Axolotl"] + [SHORT.get(b, b) for b in backends],
            body,
            right_from=1,
        )
    )


def sources_section(used: set[str]) -> str:
    lines = ["## Sources of published numbers", ""]
    for s in published.SOURCES.values():
        n = sum(1 for p in published.POINTS if p.source == s.id)
        mark = "" if s.id in used else " (no cell of this sweep matches)"
        lines.append(f"- **{s.id}**{mark}: {s.citation}. System: {s.system}. Ran: {s.software}. {s.notes} ({n} points)")
    return "\n".join(lines)
