"""Tables and plots from a sweep's results.jsonl: DIR/report.md and DIR/figures/*.png; or, for one
training run's directory (no results.jsonl; see aidaptiv_ds.harness.run_report), its loss (and held-out loss),
tokens/s and NVMe GB/s per step: DIR/figures/run_curves.png.

Everything measured comes from the rows (the newest row of each run: cell and repeat); published numbers
come from aidaptiv_ds/harness/published.py and are labelled with their source and hardware. A cell that ran
several times (the grid's repeats) shows the median tokens/s of its ok runs and their spread (min-max); its
other figures (phases, memory) are those of its median run. Per model: a throughput table in the shape of the
C-DAC paper's Table VI (rows: sequence x batch; columns: backend x GPU count; published columns beside ours
where the cell shape matches), a feasibility map per backend, the ratio aidaptiv / each other backend on the
shared cells (both ran ok at least once; the ratio of the medians, with the min-max of the per-repeat ratios,
repeat k of one against repeat k of the other, which ran close in time), where the time went, failures, and
plots of throughput against batch size and GPU count.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter, defaultdict
from typing import Optional

from aidaptiv_ds.harness import published
from aidaptiv_ds.harness.grid import SWEEP_BACKENDS
from aidaptiv_ds.harness.machine import summary as machine_summary
from aidaptiv_ds.harness.results import RESULTS_FILE, load_rows
from aidaptiv_ds.models import nominal_parameters

SHORT = {"zero3": "ZeRO-3", "zero3_cpu_offload": "ZeRO-3 CPU offload", "zero_infinity": "ZeRO-Infinity",
         "zero_infinity_eqmem": "ZeRO-Infinity (aidaptiv's memory)", "aidaptiv": "aidaptiv"}
SYMBOL = {"ok": "✓", "oom": "✗", "error": "E", "timeout": "T"}
RATIO = ("aidaptiv", "zero_infinity")


def unit_of(rows: list[dict]) -> str:
    """What a cell's 'gpus' counts: GPUs, or processes when no row's machine had a GPU (CPU runs)."""
    return "GPU" if any((r.get("machine") or {}).get("gpus") for r in rows) else "proc"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a sweep's results folder (with results.jsonl), or one train run's folder (with the "
                               "CSV monitor's aidaptiv_*.csv files or a --metrics-out JSON)")
    p.add_argument("--no-plots", action="store_true", help="tables only, no PNGs")


# ---------------------------------------------------------------------------------------------- formatting

def fmt_tps(v: Optional[float]) -> str:
    if v is None:
        return "?"
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def cell_text(row: Optional[dict]) -> str:
    """What a table cell shows for one of our cells: tokens/s (with repeats: the median of the ok runs, their
    min-max, and how many ran ok when not all did), or the status."""
    if row is None:
        return ""
    st = row["status"]
    if st == "ok":
        text = fmt_tps(row["tokens_per_s"])
        if row.get("n_ok", 1) > 1:
            text += f" ({fmt_tps(row['tps_min'])}–{fmt_tps(row['tps_max'])})"
        if row.get("n_ok", 1) < row.get("n_runs", 1):
            text += f", {row['n_ok']}/{row['n_runs']} ok"
        return text
    if st == "oom":
        return "OOM*" if row.get("inferred") else "OOM"
    return {"error": "ERR", "timeout": "TIMEOUT"}[st]


def pub_text(p: published.Point) -> str:
    if p.status == "oom":
        return "OOM"
    if p.tokens_per_s is not None:
        q = {"=": "", "~": "~", ">": ">", "<": "<", "peak": "peak "}[p.qualifier]
        v = p.tokens_per_s  # as the source writes it: no rounding
        return f"{q}{v:,}" + ("†" if p.model_assumed else "")
    if p.completion:
        return f"done {p.completion}"
    return "ran"


def md_table(header: list[str], rows: list[list[str]], right_from: int = 0) -> str:
    def esc(s):
        return str(s).replace("|", "\\|")
    out = ["| " + " | ".join(esc(h) for h in header) + " |",
           "|" + "|".join("---:" if i >= right_from else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- analysis

def _order_backends(rows) -> list[str]:
    present = {r["backend"] for r in rows}
    return [b for b in SWEEP_BACKENDS if b in present] + sorted(present - set(SWEEP_BACKENDS))


def cell_summaries(rows: list[dict]) -> list[dict]:
    """One row per cell from its runs (the newest row of each cell and repeat; rows without a repeat are
    repeat 0): the row of its median ok run (for an even count the lower middle one) with ``tokens_per_s`` and
    ``step_s`` the medians over its ok runs, or its newest row when none ran ok; and ``runs`` (its rows by
    repeat), ``n_runs``, ``n_ok``, ``tps_min``/``tps_max`` and ``tps_by_repeat`` of the ok runs."""
    by_run: dict = {}
    for r in rows:
        k = (r["key"], r.get("repeat") or 0)
        if k not in by_run or r["time_end"] >= by_run[k]["time_end"]:
            by_run[k] = r
    by_cell: dict = defaultdict(list)
    for (key, _), r in sorted(by_run.items()):
        by_cell[key].append(r)
    out = []
    for key, runs in sorted(by_cell.items()):
        ok = [r for r in runs if r["status"] == "ok" and r["tokens_per_s"]]
        if ok:
            mid = sorted(ok, key=lambda r: r["tokens_per_s"])[(len(ok) - 1) // 2]
            s = dict(mid)
            s["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ok)
            steps = [r["step_s"] for r in ok if r["step_s"]]
            s["step_s"] = statistics.median(steps) if steps else None
        else:
            s = dict(max(runs, key=lambda r: r["time_end"]))
        vals = [r["tokens_per_s"] for r in ok]
        s.update(runs=runs, n_runs=len(runs), n_ok=len(ok), tps_min=min(vals) if vals else None,
                 tps_max=max(vals) if vals else None,
                 tps_by_repeat={r.get("repeat") or 0: r["tokens_per_s"] for r in ok})
        out.append(s)
    return out


def _summarized(rows: list[dict]) -> list[dict]:
    return rows if not rows or "n_runs" in rows[0] else cell_summaries(rows)


def _shapes(rows) -> list[tuple[int, int, int]]:
    return sorted({(r["seq_len"], r["micro_batch"], r["grad_accum"]) for r in rows})


def _index(rows) -> dict:
    return {(r["backend"], r["gpus"], r["seq_len"], r["micro_batch"], r["grad_accum"]): r for r in rows}


def ratios(rows: list[dict], num: str = RATIO[0], den: str = RATIO[1]) -> dict:
    """Per shape and GPU count, on the shared cells (both ran ok at least once): num/den of the median tokens/s
    (``both``), and the min, max and count of the per-repeat ratios, repeat k against repeat k (``spread``);
    the cells only one of them ran; the median of the cell ratios. ``rows``: result rows (every run) or
    cell_summaries."""
    rows = _summarized(rows)
    idx = _index(rows)
    both, only_num, only_den, spread = {}, [], [], {}
    for (b, g, seq, mb, ga), r in idx.items():
        if b != num:
            continue
        d = idx.get((den, g, seq, mb, ga))
        if d is None:
            continue
        key = (r["model"], g, seq, mb, ga)
        if r["status"] == "ok" and d["status"] == "ok" and r["tokens_per_s"] and d["tokens_per_s"]:
            both[key] = r["tokens_per_s"] / d["tokens_per_s"]
            a, b = r.get("tps_by_repeat") or {}, d.get("tps_by_repeat") or {}
            paired = [a[k] / b[k] for k in sorted(set(a) & set(b))]
            spread[key] = (min(paired), max(paired), len(paired)) if paired else None
        elif r["status"] == "ok" and d["status"] != "ok":
            only_num.append(key)
        elif d["status"] == "ok" and r["status"] != "ok":
            only_den.append(key)
    return {"both": both, "spread": spread, "only_num": sorted(only_num), "only_den": sorted(only_den),
            "median": statistics.median(both.values()) if both else None}


def _ratio_text(ratio: float, spread) -> str:
    """'1.64×', or with more than one paired repeat '1.64× (1.52–1.71)'."""
    text = f"{ratio:.2f}×"
    if spread and spread[2] > 1:
        text += f" ({spread[0]:.2f}–{spread[1]:.2f})"
    return text


def _others(rows: list[dict]) -> list[str]:
    """The backends aidaptiv is compared with, ZeRO-Infinity first (the comparison the project is about)."""
    present = [b for b in _order_backends(rows) if b != RATIO[0]]
    return sorted(present, key=lambda b: (0 if b == RATIO[1] else 1 if b == "zero_infinity_eqmem" else 2,
                                          SWEEP_BACKENDS.index(b) if b in SWEEP_BACKENDS else 99))


def _published_columns(model: str, rows: list[dict]) -> dict:
    """{(column label, gpus): {(seq, mb, ga): Point}} for published points matching our cell shapes."""
    cols: dict = defaultdict(dict)
    for seq, mb, ga in _shapes(rows):
        for g in sorted({r["gpus"] for r in rows}):
            for p in published.matching(model, seq, mb, g):
                if p.grad_accum is not None and p.grad_accum != ga:
                    continue
                cols[(published.label(p), g)][(seq, mb, ga)] = p
    return dict(sorted(cols.items()))


# ----------------------------------------------------------------------------------------------- sections

def throughput_table(model: str, rows: list[dict]) -> tuple[str, list[str]]:
    """The Table VI-shaped table, and the sources of its published columns."""
    backends, gpus = _order_backends(rows), sorted({r["gpus"] for r in rows})
    idx = _index(rows)
    pub = _published_columns(model, rows)
    multi_ga = len({r["grad_accum"] for r in rows}) > 1
    header = ["seq", "batch"] + (["grad acc."] if multi_ga else [])
    unit = unit_of(rows)
    header += [f"{SHORT.get(b, b)} {g} {unit}" for b in backends for g in gpus]
    header += [f"{lab}, {g} GPU (published)" for lab, g in pub]
    body = []
    for seq, mb, ga in _shapes(rows):
        line = [str(seq), str(mb)] + ([str(ga)] if multi_ga else [])
        line += [cell_text(idx.get((b, g, seq, mb, ga))) for b in backends for g in gpus]
        line += [pub_text(col[(seq, mb, ga)]) if (seq, mb, ga) in col else "" for col in pub.values()]
        body.append(line)
    sources = sorted({p.source for col in pub.values() for p in col.values()})
    return md_table(header, body, right_from=2), sources


def feasibility_maps(rows: list[dict]) -> str:
    """Per backend: rows = sequence, columns = batch, one symbol per GPU count."""
    gpus = sorted({r["gpus"] for r in rows})
    idx = _index(rows)
    seqs = sorted({r["seq_len"] for r in rows})
    mbs = sorted({r["micro_batch"] for r in rows})
    gas = sorted({r["grad_accum"] for r in rows})
    parts = []
    for b in _order_backends(rows):
        body = []
        for ga in gas:
            for seq in seqs:
                line = [str(seq) + (f" (ga {ga})" if len(gas) > 1 else "")]
                for mb in mbs:
                    syms = []
                    for g in gpus:
                        r = idx.get((b, g, seq, mb, ga))
                        syms.append("·" if r is None else SYMBOL[r["status"]] + ("*" if r.get("inferred") else ""))
                    line.append(" ".join(syms))
                body.append(line)
        parts.append(f"**{SHORT.get(b, b)}** (each cell: {unit_of(rows)} counts {', '.join(map(str, gpus))})\n\n"
                     + md_table(["seq \\ batch"] + [str(m) for m in mbs], body, right_from=1))
    return "\n\n".join(parts)


def ratio_section(rows: list[dict], den: str = RATIO[1]) -> str:
    rt = ratios(rows, RATIO[0], den)
    name = SHORT.get(den, den)
    if not rt["both"] and not rt["only_num"] and not rt["only_den"]:
        return f"_No cell ran on both aidaptiv and {name}._"
    gpus = sorted({r["gpus"] for r in rows})
    body = []
    for seq, mb, ga in _shapes(rows):
        line = [str(seq), str(mb)]
        for g in gpus:
            key = (rows[0]["model"], g, seq, mb, ga)
            if key in rt["both"]:
                line.append(_ratio_text(rt["both"][key], rt["spread"].get(key)))
            elif key in rt["only_num"]:
                line.append("aidaptiv only")
            elif key in rt["only_den"]:
                line.append(f"{name} only")
            else:
                line.append("")
        body.append(line)
    med = rt["median"]
    vals = list(rt["both"].values())
    head = (f"Median aidaptiv / {name} tokens/s over {len(vals)} cell(s) where both ran: "
            f"**{med:.2f}×** (min {min(vals):.2f}×, max {max(vals):.2f}×). " if vals else
            "No cell ran on both. ")
    head += _repeat_spread_text(rt)
    head += (f"Ran on aidaptiv only: {len(rt['only_num'])}; on {name} only: {len(rt['only_den'])}.")
    return head + "\n\n" + md_table(["seq", "batch"] + [f"{g} {unit_of(rows)}" for g in gpus], body, right_from=2)


def _repeat_spread_text(rt: dict) -> str:
    """The per-repeat ratios over all shared cells, when any cell has more than one paired repeat."""
    paired = [s for s in rt["spread"].values() if s]
    if not any(s[2] > 1 for s in paired):
        return ""
    return (f"Per-repeat ratios (repeat k against repeat k) range from {min(s[0] for s in paired):.2f}× to "
            f"{max(s[1] for s in paired):.2f}× over {sum(s[2] for s in paired)} pair(s); each cell shows the ratio "
            "of its medians and that range. ")


def phases_table(rows: list[dict]) -> str:
    ok = sorted((r for r in rows if r["status"] == "ok"),
                key=lambda r: (r["seq_len"], r["micro_batch"], r["gpus"], SWEEP_BACKENDS.index(r["backend"])
                               if r["backend"] in SWEEP_BACKENDS else 9))
    if not ok:
        return "_No cell ran._"

    def f(v, nd=2):
        return "" if v is None else f"{v:.{nd}f}"
    body = []
    for r in ok:
        ph = r.get("phases_s") or {}
        body.append([SHORT.get(r["backend"], r["backend"]), str(r["gpus"]), str(r["micro_batch"]), str(r["seq_len"]),
                     f(r["step_s"], 3), f(ph.get("forward")), f(ph.get("backward")), f(ph.get("optimizer")),
                     f(ph.get("io_wait")), f(r["nvme_read_gbps"]), f(r["nvme_write_gbps"]),
                     f(r["peak_rss_mb"], 0), f(r["peak_pinned_mb"], 0), f(r["peak_gpu_mb"], 0),
                     f(r.get("cell_mem_peak_mb") or r.get("tree_peak_rss_mb"), 0)])
    return md_table(["backend", unit_of(rows) + "s", "batch", "seq", "step s (median)", "forward s", "backward s",
                     "optimizer s", "I/O wait s", "NVMe read GB/s", "NVMe write GB/s", "peak RSS MB",
                     "peak pinned MB", "peak GPU MB", "cell memory peak MB"], body, right_from=1)


def failures_table(rows: list[dict]) -> str:
    """Every run that did not end ok (a cell that ran several times may have failed in some runs only)."""
    runs = [r for s in rows for r in s.get("runs", [s])]
    bad = [r for r in runs if r["status"] != "ok" and not r.get("inferred")]
    inferred = sum(1 for r in runs if r.get("inferred"))
    repeats = any(r.get("repeat") for r in runs)
    tail = ("" if not inferred else
            f"\n\nNot run, inferred OOM from a smaller cell's OOM: {inferred} cell(s) (OOM* above)." if not repeats else
            f"\n\nNot run, inferred OOM from a smaller cell's OOM or from this cell's OOM in an earlier repeat: "
            f"{inferred} run(s) (OOM* above).")
    if not bad:
        return "_None._" + tail
    body = [[r["key"]] + ([str(r.get("repeat") or 0)] if repeats else [])
            + [r["status"], (r["error"] or "")[:200], f"{r['wall_s']:.0f}"]
            for r in sorted(bad, key=lambda r: (r["key"], r.get("repeat") or 0))]
    header = ["cell"] + (["repeat"] if repeats else []) + ["status", "error (last line)", "wall s"]
    return md_table(header, body, right_from=len(header) - 1) + tail


def eqmem_table(rows: list[dict]) -> str:
    """How each zero_infinity_eqmem cell's host memory was sized to aidaptiv's budget (harness/eqmem.py)."""
    sel = [r for r in rows if r["backend"] == "zero_infinity_eqmem" and r.get("eqmem")]
    if not sel:
        return ""
    mib = 2 ** 20
    body = []
    for r in sorted(sel, key=lambda r: (r["gpus"], r["seq_len"], r["micro_batch"])):
        e = r["eqmem"]
        body.append([str(r["gpus"]), str(r["micro_batch"]), str(r["seq_len"]), f"{e['budget_bytes'] / mib:.0f}",
                     f"{e['sized_bytes'] / mib:.0f}", f"{e['over_budget_bytes'] / mib:.0f}",
                     f"{e['max_in_cpu']:,}", f"{100 * e['cached_numel'] / max(1, e['partition_numel']):.0f}%",
                     f"{e['sub_group_size']:,}"])
    return ("Host memory DeepSpeed holds for the model state per rank (gradient partitions, swap buffers, "
            "parameter RAM cache), sized to aidaptiv's budget; over budget: ZeRO-Infinity's smallest working set "
            "exceeds it, and it runs with that minimum (see ds_configs/README.md).\n\n"
            + md_table([f"{unit_of(rows)}s", "batch", "seq", "aidaptiv budget MiB", "ZeRO-Infinity sized MiB",
                        "over budget MiB", "max_in_cpu", "parameters cached", "sub_group_size"], body, right_from=0))


def header_section(rows: list[dict], loaded, superseded: int, out_dir: str) -> str:
    """``rows``: cell summaries."""
    starts = sorted(r["time_start"] for r in rows)
    ends = sorted(r["time_end"] for r in rows)
    shas = Counter(f"{r['git_sha'] or 'unknown'}{' (dirty)' if r.get('git_dirty') else ''}" for r in rows)
    machines = {}
    for r in rows:
        machines.setdefault(machine_summary(r["machine"]), 0)
        machines[machine_summary(r["machine"])] += 1
    caps = Counter()
    for r in rows:
        hc = r["host_mem_cap"]
        host = f"{hc['gb']:g} GiB via {hc['mechanism']}" if hc.get("gb") else "none"
        gpu = f"{r['gpu_mem_cap_gb']:g} GB" if r.get("gpu_mem_cap_gb") else "none"
        caps[f"GPU memory cap {gpu}; host memory cap {host}"] += 1
    runs = Counter(f"{r['steps']} steps ({r['warmup']} warm-up, untimed)" + (f", lr {r['lr']:g}" if r.get("lr") else "")
                   + (f", timeout {r['timeout_s']:g} s" if r.get("timeout_s") else "") for r in rows)
    lines = [
        f"# Sweep report: {os.path.basename(os.path.abspath(out_dir))}",
        "",
        f"Made by `aidaptiv-ds report` from `{RESULTS_FILE}` alone: {len(rows)} cell(s), the newest row of each "
        + (f"of their {sum(r.get('n_runs', 1) for r in rows)} runs (cell and repeat: at most "
           f"{max(r.get('n_runs', 1) for r in rows)} per cell) " if any(r.get("n_runs", 1) > 1 for r in rows) else "")
        + f"({superseded} older row(s) superseded"
        + (f", {loaded.recovered} recovered from cells/*/row.json" if loaded.recovered else "")
        + (f", {len(loaded.problems)} unusable line(s) skipped" if loaded.problems else "")
        + "). Every measured number below comes from those rows; published numbers are marked as such.",
        "",
        f"- Grids: {', '.join(sorted({r['grid'] or '?' for r in rows}))}",
        f"- Dates (UTC): {starts[0]} to {ends[-1]}",
        "- git: " + "; ".join(f"{k} ({v} cells)" for k, v in shas.most_common()),
    ]
    lines += [f"- Machine: {m} ({n} cells)" for m, n in machines.items()]
    lines += [f"- {k} ({v} cells)" for k, v in caps.most_common()]
    lines += [f"- Run: {k} ({v} cells)" for k, v in runs.most_common()]
    counts = defaultdict(Counter)
    for r in rows:
        counts[r["backend"]][r["status"] + ("*" if r.get("inferred") else "")] += 1
    cols = ["ok", "oom", "oom*", "error", "timeout"]
    lines += ["", md_table(["backend"] + cols + ["cells"],
                           [[SHORT.get(b, b)] + [str(counts[b][c]) for c in cols] + [str(sum(counts[b].values()))]
                            for b in _order_backends(rows)], right_from=1)]
    lines += ["", "Cells: tokens/s (all ranks together) when the cell ran; OOM = out of memory (CUDA OOM, "
              "MemoryError, or killed by the host memory cap); OOM* = not run because a smaller cell of the same "
              "backend ran out of memory; ERR = error; TIMEOUT = killed at the time limit; empty = not in this "
              "sweep. Published columns: † = the source does not name the model exactly (see Sources)."]
    return "\n".join(lines)


def overall_ratio(rows: list[dict]) -> str:
    """One line per backend aidaptiv is compared with, over all models."""
    lines = []
    if not any(r["backend"] == RATIO[0] for r in rows):
        return ""
    for den in _others(rows):
        rt = ratios(rows, RATIO[0], den)
        vals = list(rt["both"].values())
        if not vals:
            continue
        name = SHORT.get(den, den)
        lines.append(f"**aidaptiv / {name}, all models:** median {statistics.median(vals):.2f}× over {len(vals)} "
                     f"cell(s) where both ran (cells from {min(vals):.2f}× to {max(vals):.2f}×). "
                     + _repeat_spread_text(rt) + f"aidaptiv ran {len(rt['only_num'])} cell(s) {name} could not, "
                     f"{name} {len(rt['only_den'])} that aidaptiv could not.")
    return "\n\n".join(lines)


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
            best = max((r for r in sel if r["backend"] == b and r["gpus"] == g), key=lambda r: r["tokens_per_s"] or 0,
                       default=None)
            line.append(f"{fmt_tps(best['tokens_per_s'])} (batch {best['micro_batch']})" if best else "")
        p = next((p for p in pts if p.gpus == g), None)
        line.append(f"{p.tokens_per_s:,}" + (f" (batch {p.micro_batch})" if p.micro_batch else "") if p else "")
        body.append(line)
    return ("### Peak over batch, Llama 3.1 70B at sequence 256 (C-DAC Figure 8)\n\n"
            + md_table(["GPUs"] + [SHORT.get(b, b) for b in _order_backends(sel)]
                       + ["C-DAC F.8 aiDAPTIV+ (A100 40GB PCIe, published)"], body, right_from=1))


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
    gpu_rows = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s") and r.get("peak_gpu_mb")
                and (r.get("machine") or {}).get("gpus")]
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
                best = max((r for r in gpu_rows if (r["model"], r["backend"], r["seq_len"], r["gpus"]) == (m, b, seq, g)),
                           key=lambda r: r["tokens_per_s"], default=None)
                params = best and (best.get("params") or nominal_parameters(m))
                line.append(f"{fmt_tps(best['tokens_per_s'])} (batch {best['micro_batch']}): "
                            f"{_model_flops_text(best['tokens_per_s'], params, peak and peak * g)}"
                            if best and params else "")
            for m in pub_models:
                best = max((p for p in pts if (p.model, p.seq_len, p.gpus) == (m, seq, g)),
                           key=lambda p: p.tokens_per_s, default=None)
                line.append(f"{best.tokens_per_s:,.0f} (batch {best.micro_batch}): "
                            f"{_model_flops_text(best.tokens_per_s, nominal_parameters(m), a100 * g)}" if best else "")
            body.append(line)
    header = (["seq", "GPUs"] + [f"{m} {SHORT.get(b, b)}" for m, b in columns]
              + [f"C-DAC T.VI aiDAPTIV+ {m} ({TABLE_VI_GPU}, published)" for m in pub_models])
    peak_text = f"{peak:g} TFLOP/s" if peak else "unknown (no share of peak shown)"
    return ("### Against C-DAC Table VI in model FLOP/s (best over batch per sequence)\n\n"
            f"Ours on {gpu} (dense bf16 peak {peak_text}); theirs on {TABLE_VI_GPU} ({a100:g} TFLOP/s), with the "
            "MiPhi aiDAPTIV+ kit. The models differ (a grid scales the model to the GPU cap so that the state is to "
            "the GPU what Llama 2-7B's is to an A100 40GB), so the comparable figure is the model FLOP/s, 6 x "
            "parameters x tokens/s (attention not counted: at sequence 2,048 it would add about 8% to Llama 2-7B's "
            "figure and more to a narrower model's, so leaving it out understates the smaller model's side), "
            "and its share of the peak of the GPUs that ran it.\n\n"
            + md_table(header, body, right_from=2))


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
        ours = {r["backend"]: r for r in sel if (r["model"], r["seq_len"], r["micro_batch"], r["gpus"]) == (model, seq, mb, g)}
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
    return ("### Signal65 configurations (sequence 12,000, gradient accumulation 10)\n\n"
            "Published: aiDAPTIV+ completion time of one epoch (672 samples) and Axolotl's out-of-memory, on "
            "RTX 6000 Ada 48 GB. Ours: tokens/s, and the time 672 full 12,000-token sequences would take at that "
            "rate; their samples were likely shorter, so that time is an upper bound, not a like-for-like "
            "figure.\n\n"
            + md_table(["model", "batch", "GPUs", "Signal65 aiDAPTIV+", "Signal65 Axolotl"]
                       + [SHORT.get(b, b) for b in backends], body, right_from=1))


def sources_section(used: set[str]) -> str:
    lines = ["## Sources of published numbers", ""]
    for s in published.SOURCES.values():
        n = sum(1 for p in published.POINTS if p.source == s.id)
        mark = "" if s.id in used else " (no cell of this sweep matches)"
        lines.append(f"- **{s.id}**{mark}: {s.citation}. System: {s.system}. Ran: {s.software}. {s.notes} "
                     f"({n} points)")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- plots

def _plots(model: str, rows: list[dict], fig_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    unit = unit_of(rows)
    backends = _order_backends(rows)
    colors = {b: c for b, c in zip(SWEEP_BACKENDS, ("tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:green"))}
    ok = [r for r in rows if r["status"] == "ok" and r["tokens_per_s"]]
    seqs = sorted({r["seq_len"] for r in rows})
    gpus = sorted({r["gpus"] for r in rows})
    mbs = sorted({r["micro_batch"] for r in rows})
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]

    def grid_axes(n):
        ncols = min(3, n)
        nrows = (n + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        return fig, list(axes.flat)

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(fig_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    if ok and len(mbs) > 1:
        fig, axes = grid_axes(len(seqs))
        for ax, seq in zip(axes, seqs):
            for b in backends:
                for i, g in enumerate(gpus):
                    pts = sorted((r["micro_batch"], r["tokens_per_s"]) for r in ok
                                 if r["backend"] == b and r["gpus"] == g and r["seq_len"] == seq)
                    if pts:
                        ax.plot(*zip(*pts), styles[i % 4], marker=markers[i % 8], color=colors.get(b),
                                label=f"{SHORT.get(b, b)}, {g} {unit}")
            pub = defaultdict(list)
            for p in published.POINTS:
                if (p.model == model and p.seq_len == seq and p.micro_batch and p.tokens_per_s and p.gpus in gpus
                        and p.qualifier == "="):
                    pub[(published.label(p), p.gpus)].append((p.micro_batch, p.tokens_per_s))
            for k, ((lab, g), pp) in enumerate(sorted(pub.items())):
                ax.plot(*zip(*sorted(pp)), "x+12348"[k % 7], color="black", markersize=7,
                        label=f"published: {lab}, {g} GPU")
            ax.set_title(f"{model}, seq {seq}")
            ax.set_xlabel(f"micro-batch per {unit}")
            ax.set_ylabel("tokens/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        save(fig, f"{model}_tput_vs_batch.png")

    if ok and len(gpus) > 1:
        fig, axes = grid_axes(len(seqs))
        for ax, seq in zip(axes, seqs):
            for b in backends:
                for j, mb in enumerate(mbs):
                    pts = sorted((r["gpus"], r["tokens_per_s"]) for r in ok
                                 if r["backend"] == b and r["micro_batch"] == mb and r["seq_len"] == seq)
                    if pts:
                        ax.plot(*zip(*pts), styles[j % 4], marker=markers[j % 8], color=colors.get(b),
                                label=f"{SHORT.get(b, b)}, batch {mb}")
            ax.set_title(f"{model}, seq {seq}")
            ax.set_xlabel("GPUs" if unit == "GPU" else "processes (CPU)")
            ax.set_ylabel("tokens/s")
            ax.set_xticks(gpus)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
        save(fig, f"{model}_tput_vs_gpus.png")

    # Feasibility: one panel per backend x GPU count, sequence x batch coloured by status.
    from matplotlib.colors import ListedColormap
    codes = {"ok": 0, "oom*": 1, "oom": 2, "timeout": 3, "error": 4}
    cmap = ListedColormap(["#4caf50", "#ffcdd2", "#e53935", "#ff9800", "#7e57c2"])
    idx = _index(rows)
    ga = max({r["grad_accum"] for r in rows}, key=lambda a: sum(1 for r in rows if r["grad_accum"] == a))
    fig, axes = plt.subplots(len(backends), len(gpus), figsize=(max(6.0, 1.2 + 0.7 * len(mbs) * len(gpus)),
                                                                1.0 + 0.5 * (len(seqs) + 1) * len(backends)),
                             squeeze=False)
    import numpy as np
    for i, b in enumerate(backends):
        for j, g in enumerate(gpus):
            ax = axes[i][j]
            data = np.full((len(seqs), len(mbs)), np.nan)
            for si, seq in enumerate(seqs):
                for mi, mb in enumerate(mbs):
                    r = idx.get((b, g, seq, mb, ga))
                    if r is not None:
                        k = r["status"] + ("*" if r.get("inferred") else "")
                        data[si, mi] = codes[k]
                        ax.text(mi, si, SYMBOL[r["status"]] + ("*" if r.get("inferred") else ""), ha="center",
                                va="center", fontsize=7)
            ax.imshow(data, cmap=cmap, vmin=0, vmax=4, aspect="auto")
            ax.set_xticks(range(len(mbs)), [str(m) for m in mbs], fontsize=7)
            ax.set_yticks(range(len(seqs)), [str(s) for s in seqs], fontsize=7)
            ax.set_title(f"{SHORT.get(b, b)}, {g} {unit}", fontsize=8)
            if i == len(backends) - 1:
                ax.set_xlabel("batch", fontsize=7)
            if j == 0:
                ax.set_ylabel("seq", fontsize=7)
    fig.suptitle(f"{model}: which cells ran\n✓ ok, ✗ OOM, ✗* inferred OOM, E error, T timeout", fontsize=9)
    save(fig, f"{model}_feasibility.png")
    return made


# ----------------------------------------------------------------------------------------------- the report

def build_report(out_dir: str, plots: bool = True) -> tuple[str, list[str]]:
    """(markdown, figure paths) for a results folder."""
    loaded = load_rows(out_dir)
    rows = cell_summaries(loaded.rows)
    if not rows:
        raise ValueError(f"{os.path.join(out_dir, RESULTS_FILE)} has no usable rows: run `aidaptiv-ds sweep` first "
                         "(or give one train run's folder: aidaptiv_*.csv from a \"csv_monitor\" or a metrics JSON)")
    superseded = len(loaded.rows) - sum(r["n_runs"] for r in rows)
    parts = [header_section(rows, loaded, superseded, out_dir)]
    ov = overall_ratio(rows)
    if ov:
        parts.append(ov)
    fig_dir = os.path.join(out_dir, "figures")
    figures: list[str] = []
    used_sources: set[str] = set()
    models = sorted({r["model"] for r in rows}, key=lambda m: (nominal_parameters(m) or 0, m))
    for model in models:
        mrows = [r for r in rows if r["model"] == model]
        params = (next((r["params"] for r in mrows if r.get("params_source") == "metrics"), None)
                  or nominal_parameters(model))
        ptxt = f" ({params / 1e9:.2f} B parameters)" if params and params >= 1e9 else \
            f" ({params / 1e6:.1f} M parameters)" if params else ""
        table, sources = throughput_table(model, mrows)
        used_sources |= set(sources)
        parts += [f"## {model}{ptxt}", "### Throughput, tokens/s (shape of C-DAC Table VI)", table]
        if sources:
            parts.append("Published columns from: " + ", ".join(sources) + " (see Sources).")
        parts += ["### Feasibility per backend (✓ ok, ✗ OOM, ✗* inferred OOM, E error, T timeout, · not run)",
                  feasibility_maps(mrows)]
        if any(r["backend"] == RATIO[0] for r in mrows):
            for den in _others(mrows):
                parts += [f"### aidaptiv / {SHORT.get(den, den)} (tokens/s ratio where both ran)",
                          ratio_section(mrows, den)]
        sizing = eqmem_table(mrows)
        if sizing:
            parts += ["### ZeRO-Infinity with aidaptiv's host memory: the sizing", sizing]
        parts += ["### Where the time went (cells that ran; with repeats, the median run)", phases_table(mrows),
                  "### Failures", failures_table(mrows)]
        if plots:
            try:
                os.makedirs(fig_dir, exist_ok=True)
                made = _plots(model, mrows, fig_dir)
            except ImportError as e:
                made = []
                parts.append(f"_No plots: {e} (pip install matplotlib)._")
            figures += made
            parts += [f"![{os.path.basename(p)[:-4]}](figures/{os.path.basename(p)})" for p in made]
    extras = [(src, text) for src, text in (("cdac-t6", table_vi_flops_section(rows)),
                                            ("cdac-f8", figure8_section(rows)), ("signal65", signal65_section(rows)))
              if text]
    if extras:
        parts.append("## Published comparisons")
        for src, text in extras:
            parts.append(text)
            used_sources.add(src)
    parts.append(sources_section(used_sources))
    if loaded.problems:
        parts += ["## Unusable lines", "\n".join(f"- {p}" for p in loaded.problems[:50])]
    return "\n\n".join(parts) + "\n", figures


def run(args: argparse.Namespace) -> int:
    if os.path.isdir(args.dir) and not os.path.exists(os.path.join(args.dir, RESULTS_FILE)):
        from aidaptiv_ds.harness import run_report
        series, source = run_report.find_series(args.dir)
        if series:   # one run's folder; a folder with neither gets the sweep's "no usable rows" below
            path = run_report.plot(args.dir, series, source)
            print(f"wrote {path} ({', '.join(sorted(series))} from the {source})", file=sys.stderr)
            return 0
    try:
        md, figures = build_report(args.dir, plots=not args.no_plots)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = os.path.join(args.dir, "report.md")
    with open(path, "w") as f:
        f.write(md)
    print(f"wrote {path}" + (f" and {len(figures)} figure(s) in {os.path.join(args.dir, 'figures')}" if figures else ""),
          file=sys.stderr)
    return 0

