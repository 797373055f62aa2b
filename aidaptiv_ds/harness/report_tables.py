"""The report's tables, made from a sweep's rows: throughput per cell beside the published figures, the
feasibility maps, ratios between backends with their spread over repeats, phases, failures and the
equal-memory comparison."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Optional

from aidaptiv_ds.harness import published
from aidaptiv_ds.harness.grid import SWEEP_BACKENDS

SHORT = {
    "zero3": "ZeRO-3",
    "zero3_cpu_offload": "ZeRO-3 CPU offload",
    "zero_infinity": "ZeRO-Infinity",
    "zero_infinity_eqmem": "ZeRO-Infinity (aidaptiv's memory)",
    "aidaptiv": "aidaptiv",
}


SYMBOL = {"ok": "✓", "oom": "✗", "error": "E", "timeout": "T"}


RATIO = ("aidaptiv", "zero_infinity")


def unit_of(rows: list[dict]) -> str:
    """What a cell's 'gpus' counts: GPUs, or processes when no row's machine had a GPU (CPU runs)."""
    return "GPU" if any((r.get("machine") or {}).get("gpus") for r in rows) else "proc"


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

    out = [
        "| " + " | ".join(esc(h) for h in header) + " |",
        "|" + "|".join("---:" if i >= right_from else "---" for i in range(len(header))) + "|",
    ]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


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
        s.update(
            runs=runs,
            n_runs=len(runs),
            n_ok=len(ok),
            tps_min=min(vals) if vals else None,
            tps_max=max(vals) if vals else None,
            tps_by_repeat={r.get("repeat") or 0: r["tokens_per_s"] for r in ok},
        )
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
    return {
        "both": both,
        "spread": spread,
        "only_num": sorted(only_num),
        "only_den": sorted(only_den),
        "median": statistics.median(both.values()) if both else None,
    }


def _ratio_text(ratio: float, spread) -> str:
    """'1.64×', or with more than one paired repeat '1.64× (1.52–1.71)'."""
    text = f"{ratio:.2f}×"
    if spread and spread[2] > 1:
        text += f" ({spread[0]:.2f}–{spread[1]:.2f})"
    return text


def _others(rows: list[dict]) -> list[str]:
    """The backends aidaptiv is compared with, ZeRO-Infinity first (the comparison the project is about)."""
    present = [b for b in _order_backends(rows) if b != RATIO[0]]
    return sorted(
        present,
        key=lambda b: (
            0 if b == RATIO[1] else 1 if b == "zero_infinity_eqmem" else 2,
            SWEEP_BACKENDS.index(b) if b in SWEEP_BACKENDS else 99,
        ),
    )


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
        parts.append(
            f"**{SHORT.get(b, b)}** (each cell: {unit_of(rows)} counts {', '.join(map(str, gpus))})\n\n"
            + md_table(["seq \\ batch"] + [str(m) for m in mbs], body, right_from=1)
        )
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
    head = (
        f"Median aidaptiv / {name} tokens/s over {len(vals)} cell(s) where both ran: "
        f"**{med:.2f}×** (min {min(vals):.2f}×, max {max(vals):.2f}×). "
        if vals
        else "No cell ran on both. "
    )
    head += _repeat_spread_text(rt)
    head += f"Ran on aidaptiv only: {len(rt['only_num'])}; on {name} only: {len(rt['only_den'])}."
    return head + "\n\n" + md_table(["seq", "batch"] + [f"{g} {unit_of(rows)}" for g in gpus], body, right_from=2)


def _repeat_spread_text(rt: dict) -> str:
    """The per-repeat ratios over all shared cells, when any cell has more than one paired repeat."""
    paired = [s for s in rt["spread"].values() if s]
    if not any(s[2] > 1 for s in paired):
        return ""
    return (
        f"Per-repeat ratios (repeat k against repeat k) range from {min(s[0] for s in paired):.2f}× to "
        f"{max(s[1] for s in paired):.2f}× over {sum(s[2] for s in paired)} pair(s); each cell shows the ratio "
        "of its medians and that range. "
    )


def phases_table(rows: list[dict]) -> str:
    ok = sorted(
        (r for r in rows if r["status"] == "ok"),
        key=lambda r: (
            r["seq_len"],
            r["micro_batch"],
            r["gpus"],
            SWEEP_BACKENDS.index(r["backend"]) if r["backend"] in SWEEP_BACKENDS else 9,
        ),
    )
    if not ok:
        return "_No cell ran._"

    def f(v, nd=2):
        return "" if v is None else f"{v:.{nd}f}"

    body = []
    for r in ok:
        ph = r.get("phases_s") or {}
        body.append(
            [
                SHORT.get(r["backend"], r["backend"]),
                str(r["gpus"]),
                str(r["micro_batch"]),
                str(r["seq_len"]),
                f(r["step_s"], 3),
                f(ph.get("forward")),
                f(ph.get("backward")),
                f(ph.get("optimizer")),
                f(ph.get("io_wait")),
                f(r["nvme_read_gbps"]),
                f(r["nvme_write_gbps"]),
                f(r["peak_rss_mb"], 0),
                f(r["peak_pinned_mb"], 0),
                f(r["peak_gpu_mb"], 0),
                f(r.get("cell_mem_peak_mb") or r.get("tree_peak_rss_mb"), 0),
            ]
        )
    return md_table(
        [
            "backend",
            unit_of(rows) + "s",
            "batch",
            "seq",
            "step s (median)",
            "forward s",
            "backward s",
            "optimizer s",
            "I/O wait s",
            "NVMe read GB/s",
            "NVMe write GB/s",
            "peak RSS MB",
            "peak pinned MB",
            "peak GPU MB",
            "cell memory peak MB",
        ],
        body,
        right_from=1,
    )


def failures_table(rows: list[dict]) -> str:
    """Every run that did not end ok (a cell that ran several times may have failed in some runs only)."""
    runs = [r for s in rows for r in s.get("runs", [s])]
    bad = [r for r in runs if r["status"] != "ok" and not r.get("inferred")]
    inferred = sum(1 for r in runs if r.get("inferred"))
    repeats = any(r.get("repeat") for r in runs)
    tail = (
        ""
        if not inferred
        else f"\n\nNot run, inferred OOM from a smaller cell's OOM: {inferred} cell(s) (OOM* above)."
        if not repeats
        else f"\n\nNot run, inferred OOM from a smaller cell's OOM or from this cell's OOM in an earlier repeat: "
        f"{inferred} run(s) (OOM* above)."
    )
    if not bad:
        return "_None._" + tail
    body = [
        [r["key"]]
        + ([str(r.get("repeat") or 0)] if repeats else [])
        + [r["status"], (r["error"] or "")[:200], f"{r['wall_s']:.0f}"]
        for r in sorted(bad, key=lambda r: (r["key"], r.get("repeat") or 0))
    ]
    header = ["cell"] + (["repeat"] if repeats else []) + ["status", "error (last line)", "wall s"]
    return md_table(header, body, right_from=len(header) - 1) + tail


def eqmem_table(rows: list[dict]) -> str:
    """How each zero_infinity_eqmem cell's host memory was sized to aidaptiv's budget (harness/eqmem.py)."""
    sel = [r for r in rows if r["backend"] == "zero_infinity_eqmem" and r.get("eqmem")]
    if not sel:
        return ""
    mib = 2**20
    body = []
    for r in sorted(sel, key=lambda r: (r["gpus"], r["seq_len"], r["micro_batch"])):
        e = r["eqmem"]
        body.append(
            [
                str(r["gpus"]),
                str(r["micro_batch"]),
                str(r["seq_len"]),
                f"{e['budget_bytes'] / mib:.0f}",
                f"{e['sized_bytes'] / mib:.0f}",
                f"{e['over_budget_bytes'] / mib:.0f}",
                f"{e['max_in_cpu']:,}",
                f"{100 * e['cached_numel'] / max(1, e['partition_numel']):.0f}%",
                f"{e['sub_group_size']:,}",
            ]
        )
    return (
        "Host memory DeepSpeed holds for the model state per rank (gradient partitions, swap buffers, "
        "parameter RAM cache), sized to aidaptiv's budget; over budget: ZeRO-Infinity's smallest working set "
        "exceeds it, and it runs with that minimum (see ds_configs/README.md).\n\n"
        + md_table(
            [
                f"{unit_of(rows)}s",
                "batch",
                "seq",
                "aidaptiv budget MiB",
                "ZeRO-Infinity sized MiB",
                "over budget MiB",
                "max_in_cpu",
                "parameters cached",
                "sub_group_size",
            ],
            body,
            right_from=0,
        )
    )


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
        lines.append(
            f"**aidaptiv / {name}, all models:** median {statistics.median(vals):.2f}× over {len(vals)} "
            f"cell(s) where both ran (cells from {min(vals):.2f}× to {max(vals):.2f}×). "
            + _repeat_spread_text(rt)
            + f"aidaptiv ran {len(rt['only_num'])} cell(s) {name} could not, "
            f"{name} {len(rt['only_den'])} that aidaptiv could not."
        )
    return "\n\n".join(lines)
