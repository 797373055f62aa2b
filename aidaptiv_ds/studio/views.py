"""What the studio's page shows, read from the disk: the plan's verdict per backend, the runs table, one run's
status, curves and log, and a sweep's report with its figures. Pure readers of the workspace and the runs'
files (a sweep's report is made by `aidaptiv-ds report` when missing or stale); the page (app.py) wires them to
its components."""

from __future__ import annotations

import os
import sys
import time

from aidaptiv_ds.common.sizes import format_size as _size
from aidaptiv_ds.studio import children
from aidaptiv_ds.studio.runs import Runs
from aidaptiv_ds.studio.workspace import StudioError, Workspace

LOG_LINES = 14  # the log box shows this many of the run's last lines, all at once (long ones wrap: room for twice)


def render_plan(plan: dict, mode: str) -> str:
    """The plan's verdict per backend as a table, then each backend's memory item by item."""
    lines = [
        "| backend | fits | activations | host / rank | NVMe / node | GPU / rank | predicted tokens/s | why not |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, b in plan["backends"].items():
        t = b.get("totals", {})
        pred = (b.get("prediction") or {}).get("tokens_per_s")
        lines.append(
            f"| {name} | {'yes' if b['fits'] else '**no**'} | {b.get('activations', '')} | "
            f"{_size(t.get('host_per_rank', 0))} | {_size(t.get('nvme_per_node', 0))} | "
            f"{_size(t.get('gpu_per_rank', 0))} | {f'{pred:,.0f}' if pred else '-'} | "
            f"{'; '.join(b.get('problems', [])) or ''} |"
        )
    for name, b in plan["backends"].items():
        lines += ["", f"**{name}: memory per rank**", "", "| where | what | bytes |", "|---|---|---|"]
        for where, key in (
            ("host (pinned)", "host_pinned_bytes_per_rank"),
            ("host", "host_pageable_bytes_per_rank"),
            ("NVMe", "nvme_bytes_per_rank"),
            ("GPU", "gpu_bytes_per_rank"),
        ):
            for what, n in (b.get(key) or {}).items():
                lines.append(f"| {where} | {what} | {_size(n)} |")
        if b.get("notes"):
            lines += ["", "Notes: " + "; ".join(b["notes"])]
    if mode == "lora":
        lines += [
            "",
            "The plan counts full fine-tuning of every weight; LoRA trains adapters only and needs less: the frozen "
            "base's own bytes on the swap disk, which the train job checks at launch.",
        ]
    return "\n".join(lines)


def runs_table(runs: Runs) -> list[list]:
    out = []
    for name in runs.names():
        s, st, m = runs.settings(name), runs.status(name), runs.metrics(name)
        curves = runs.curves(name)
        loss = curves.get("loss", [])
        out.append(
            [
                name,
                os.path.basename(s.model),
                s.mode,
                st.get("state"),
                loss[-1][0] if loss else 0,
                round(loss[-1][1], 4) if loss else "",
                round(m["tokens_per_s"], 1) if m.get("tokens_per_s") else "",
                time.strftime("%Y-%m-%d %H:%M", time.localtime(st["started"])) if st.get("started") else "",
            ]
        )
    return out


def curve_frame(curves: dict, names: tuple[str, ...]):
    import pandas as pd

    rows = [(step, value, name) for name in names for step, value in curves.get(name, [])]
    return pd.DataFrame(rows, columns=["step", "value", "series"])


def run_view(runs: Runs, name: str):
    """(status markdown, loss frame, speed frame, NVMe frame, memory frame, log) of one run."""
    if not name:
        return ("Pick a run.", curve_frame({}, ()), curve_frame({}, ()), curve_frame({}, ()), curve_frame({}, ()), "")
    s, st, m, curves = runs.settings(name), runs.status(name), runs.metrics(name), runs.curves(name)
    loss = curves.get("loss", [])
    lines = [f"**{name}**: {st.get('state')} (attempt {st.get('attempt', 0)})"]
    goal = f" of {s.steps}" if s.steps else ""
    lines.append(
        f"step {loss[-1][0] if loss else 0}{goal}; {s.mode}, {os.path.basename(s.model)}, data {os.path.basename(s.data)}"
    )
    if loss:
        lines.append(f"loss {loss[0][1]:.4f} -> {loss[-1][1]:.4f}")
    if m.get("tokens_per_s"):
        lines.append(f"last attempt: {m['tokens_per_s']:.1f} tokens/s, peak RSS {m.get('peak_rss_mb', 0):.0f} MB")
    if st.get("message"):
        lines.append(f"**{st['message']}**")
    if st.get("state") == "failed":
        lines.append("**It failed**: the log below says why, in the product's words.")
    memory = {k: [(x, y / 2**20) for x, y in curves.get(k, [])] for k in ("pinned_bytes", "host_budget_bytes")}
    memory["host_rss_mb"] = curves.get("host_rss_mb", [])
    memory["gpu_mem_mb"] = curves.get("gpu_mem_mb", [])
    return (
        "  \n".join(lines),
        curve_frame(curves, ("loss", "eval_loss")),
        curve_frame(curves, ("tokens_per_s",)),
        curve_frame(curves, ("nvme_read_GBps", "nvme_write_GBps")),
        curve_frame(memory, ("host_rss_mb", "pinned_bytes", "host_budget_bytes", "gpu_mem_mb")),
        runs.log_tail(name, LOG_LINES),
    )


def sweep_folders(ws: Workspace) -> list[str]:
    return [ws.relative(p.parent) for p in sorted(ws.sweeps.glob("**/results.jsonl"))]


def sweep_report(ws: Workspace, folder: str):
    """(report markdown, figure paths) of a sweep folder; the report is made when missing or older than the
    results."""
    d = ws.inside(folder, "sweep folder")
    results, report = d / "results.jsonl", d / "report.md"
    if not results.exists():
        raise StudioError(f"{folder} has no results.jsonl: it is no sweep folder")
    if not report.exists() or report.stat().st_mtime < results.stat().st_mtime:
        done = children.run([sys.executable, "-m", "aidaptiv_ds", "report", str(d)], timeout=600)
        if done.returncode != 0:
            raise StudioError(f"aidaptiv-ds report failed: {done.stderr.strip()[-800:]}")
    # The report's image links are relative to its folder, which the page cannot follow: the figures go to the
    # gallery instead, and each link becomes its caption.
    import re

    md = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"*(figure: \1, in the gallery below)*", report.read_text())
    return md, [str(p) for p in sorted((d / "figures").glob("*.png"))]
