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

import os
from collections import Counter, defaultdict

from aidaptiv_ds.common.extras import install_command
from aidaptiv_ds.harness.machine import summary as machine_summary
from aidaptiv_ds.harness.report_figures import _plots
from aidaptiv_ds.harness.report_studies import (
    figure8_section,
    signal65_section,
    sources_section,
    table_vi_flops_section,
)
from aidaptiv_ds.harness.report_tables import (
    RATIO,
    SHORT,
    _order_backends,
    _others,
    cell_summaries,
    eqmem_table,
    failures_table,
    feasibility_maps,
    md_table,
    overall_ratio,
    phases_table,
    ratio_section,
    throughput_table,
)
from aidaptiv_ds.harness.results import RESULTS_FILE, load_rows
from aidaptiv_ds.models.presets import nominal_parameters


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
    runs = Counter(
        f"{r['steps']} steps ({r['warmup']} warm-up, untimed)"
        + (f", lr {r['lr']:g}" if r.get("lr") else "")
        + (f", timeout {r['timeout_s']:g} s" if r.get("timeout_s") else "")
        for r in rows
    )
    lines = [
        f"# Sweep report: {os.path.basename(os.path.abspath(out_dir))}",
        "",
        f"Made by `aidaptiv-ds report` from `{RESULTS_FILE}` alone: {len(rows)} cell(s), the newest row of each "
        + (
            f"of their {sum(r.get('n_runs', 1) for r in rows)} runs (cell and repeat: at most "
            f"{max(r.get('n_runs', 1) for r in rows)} per cell) "
            if any(r.get("n_runs", 1) > 1 for r in rows)
            else ""
        )
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
    lines += [
        "",
        md_table(
            ["backend"] + cols + ["cells"],
            [
                [SHORT.get(b, b)] + [str(counts[b][c]) for c in cols] + [str(sum(counts[b].values()))]
                for b in _order_backends(rows)
            ],
            right_from=1,
        ),
    ]
    lines += [
        "",
        "Cells: tokens/s (all ranks together) when the cell ran; OOM = out of memory (CUDA OOM, "
        "MemoryError, or killed by the host memory cap); OOM* = not run because a smaller cell of the same "
        "backend ran out of memory; ERR = error; TIMEOUT = killed at the time limit; empty = not in this "
        "sweep. Published columns: † = the source does not name the model exactly (see Sources).",
    ]
    return "\n".join(lines)


def build_report(out_dir: str, plots: bool = True) -> tuple[str, list[str]]:
    """(markdown, figure paths) for a results folder."""
    loaded = load_rows(out_dir)
    rows = cell_summaries(loaded.rows)
    if not rows:
        raise ValueError(
            f"{os.path.join(out_dir, RESULTS_FILE)} has no usable rows: run `aidaptiv-ds sweep` first "
            '(or give one train run\'s folder: aidaptiv_*.csv from a "csv_monitor" or a metrics JSON)'
        )
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
        params = next((r["params"] for r in mrows if r.get("params_source") == "metrics"), None) or nominal_parameters(
            model
        )
        ptxt = (
            f" ({params / 1e9:.2f} B parameters)"
            if params and params >= 1e9
            else f" ({params / 1e6:.1f} M parameters)"
            if params
            else ""
        )
        table, sources = throughput_table(model, mrows)
        used_sources |= set(sources)
        parts += [f"## {model}{ptxt}", "### Throughput, tokens/s (shape of C-DAC Table VI)", table]
        if sources:
            parts.append("Published columns from: " + ", ".join(sources) + " (see Sources).")
        parts += [
            "### Feasibility per backend (✓ ok, ✗ OOM, ✗* inferred OOM, E error, T timeout, · not run)",
            feasibility_maps(mrows),
        ]
        if any(r["backend"] == RATIO[0] for r in mrows):
            for den in _others(mrows):
                parts += [
                    f"### aidaptiv / {SHORT.get(den, den)} (tokens/s ratio where both ran)",
                    ratio_section(mrows, den),
                ]
        sizing = eqmem_table(mrows)
        if sizing:
            parts += ["### ZeRO-Infinity with aidaptiv's host memory: the sizing", sizing]
        parts += [
            "### Where the time went (cells that ran; with repeats, the median run)",
            phases_table(mrows),
            "### Failures",
            failures_table(mrows),
        ]
        if plots:
            try:
                os.makedirs(fig_dir, exist_ok=True)
                made = _plots(model, mrows, fig_dir)
            except ImportError as e:
                made = []
                parts.append(f"_No plots: {e} ({install_command('matplotlib')})._")
            figures += made
            parts += [f"![{os.path.basename(p)[:-4]}](figures/{os.path.basename(p)})" for p in made]
    extras = [
        (src, text)
        for src, text in (
            ("cdac-t6", table_vi_flops_section(rows)),
            ("cdac-f8", figure8_section(rows)),
            ("signal65", signal65_section(rows)),
        )
        if text
    ]
    if extras:
        parts.append("## Published comparisons")
        for src, text in extras:
            parts.append(text)
            used_sources.add(src)
    parts.append(sources_section(used_sources))
    if loaded.problems:
        parts += ["## Unusable lines", "\n".join(f"- {p}" for p in loaded.problems[:50])]
    return "\n\n".join(parts) + "\n", figures
