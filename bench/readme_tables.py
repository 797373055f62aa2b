#!/usr/bin/env python3
"""Write the generated tables of the docs from the committed rows under bench/results and the code (never by hand).

    python bench/readme_tables.py            # rewrites docs/RESULTS.md between the results markers and
                                             # docs/USAGE.md between the settings markers
    python bench/readme_tables.py --print    # prints both sections instead

Results (docs/RESULTS.md) from the committed rows under bench/results/<study>/<variant>/: io_engines/2core_vm/rows.jsonl
(last row, and every row's ratios); the summary.md of swap_step_time/{tiny, small, tiny-moe, tinyllama-1.1b, qwen2.5-3b,
qwen2.5-3b_eighth} and heap_settings/{tiny, small} (each written from its rows); user_paths/tiny/rows.jsonl;
cpu_small/xeon/results.jsonl; cpu_small_repeats/epyc/results.jsonl; the summary.md of capacity_models/cap_8gib
and capacity_models/moe_cap_8gib
(bench/capacity_models.py's), lora_memory/tinyllama-1.1b, capacity_seq_len/cap_5gib (bench/capacity_seq_len.py's,
from its rows), long_sequence/tiny, generate_offload/{tinyllama-1.1b_fp32, tinyllama-1.1b_bf16, qwen2.5-3b_bf16,
tinyllama-1.1b_fp32_zero_inference} and io_order/2core_vm; gpu_*/*/results.jsonl (through the sweep report's tables);
faults/micro/rows.jsonl. Paths in the generated text are code spans relative to the repository root,
not links. The settings table (docs/USAGE.md) from the block's pydantic model, aidaptiv_ds.config.schema.
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BEGIN, END = "<!-- results:begin (bench/readme_tables.py) -->", "<!-- results:end -->"
SETTINGS_BEGIN, SETTINGS_END = "<!-- settings:begin (bench/readme_tables.py) -->", "<!-- settings:end -->"
RESULTS_DOC = os.path.join("docs", "RESULTS.md")  # the results markers live here
SETTINGS_DOC = os.path.join("docs", "USAGE.md")  # the settings markers live here
RESULTS = os.path.join("bench", "results")  # <study>/<variant>/ with its rows and summary, from the root


def _rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def io_bench_section():
    rows = _rows(os.path.join(ROOT, RESULTS, "io_engines", "2core_vm", "rows.jsonl"))
    if not rows:
        return [
            "(no io-bench rows yet: `python bench/io_engines.py --json >> bench/results/io_engines/2core_vm/rows.jsonl`)"
        ]
    row = rows[-1]
    m, c = row["machine"], row.get("config", {})
    from aidaptiv_ds.harness.machine import cpu_line

    out = [
        f"**I/O engines** (`aidaptiv-ds io-bench`): {cpu_line(m)}, {m.get('cores', '?')} cores, kernel "
        f"{m.get('kernel', '?')}, {m.get('disk', m.get('device', '?'))}; {c.get('size_mb', '?')} MiB per engine, "
        f"{c.get('block_kb', '?')} KiB blocks, queue depth {c.get('queue_depth', '?')}, O_DIRECT, "
        f"{c.get('repeat', '?')} interleaved repeats, medians" + (f"; {row['time']}" if row.get("time") else "") + ".",
        "",
        "| engine | read GB/s | write GB/s | CPU s per GB read | CPU s per GB write | bytes verified |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in row["engines"].items():
        if "error" in e:
            out.append(f"| {name} | - | - | - | - | {e['error'][:80]} |")
            continue
        f = lambda k, d=2: "-" if e.get(k) is None else f"{e[k]:.{d}f}"
        out.append(
            f"| {name} | {f('read_gbps')} | {f('write_gbps')} | {f('cpu_s_per_gb_read', 3)} | "
            f"{f('cpu_s_per_gb_write', 3)} | {e.get('verified', 'n/a')} |"
        )
    eng = row["engines"]
    if "uring" in eng and "fio" in eng and "error" not in eng["fio"]:
        out += [
            "",
            f"io_uring engine / fio io_uring: read {eng['uring']['read_gbps'] / eng['fio']['read_gbps']:.2f}x, "
            f"write {eng['uring']['write_gbps'] / eng['fio']['write_gbps']:.2f}x.",
        ]
    if "uring" in eng and "deepspeed" in eng and "error" not in eng["deepspeed"]:
        u, d = eng["uring"], eng["deepspeed"]
        out.append(
            f"io_uring engine / DeepSpeed's libaio handle: read {u['read_gbps'] / d['read_gbps']:.2f}x, write "
            f"{u['write_gbps'] / d['write_gbps']:.2f}x; CPU per GB {u['cpu_s_per_gb_read'] / d['cpu_s_per_gb_read']:.2f}x "
            f"(read), {u['cpu_s_per_gb_write'] / d['cpu_s_per_gb_write']:.2f}x (write)."
        )
    if len(rows) > 1:
        # The disk is shared and noisy: show every committed run's ratios, not only the latest.
        runs = []
        for r in rows:
            e = r["engines"]
            ratio = lambda other, k: (
                f"{e['uring'][k] / e[other][k]:.2f}x"
                if other in e and "error" not in e[other] and "uring" in e and "error" not in e["uring"]
                else "-"
            )
            runs.append(
                f"vs fio {ratio('fio', 'read_gbps')}/{ratio('fio', 'write_gbps')}, vs DeepSpeed "
                f"{ratio('deepspeed', 'read_gbps')}/{ratio('deepspeed', 'write_gbps')}"
            )
        out += [
            "",
            f"All {len(rows)} committed runs (io_uring engine read/write bandwidth ratios): " + "; ".join(runs) + ".",
            "",
            "The order reverses every repeat, so the engines at the two ends of it run twice in a row at each turn "
            "(the first of a repeat writes right after its own write of the last), and on this disk a write right after a "
            "write tends to run slower, which weighs on those engines' medians. For the ratio of two engines, "
            "bench/io_order.py pairs them with the order alternating (below).",
        ]
    return out


def summary_md(folder, command):
    """A benchmark's own OUT/summary.md (written from its rows), its title in bold with the command. ``folder``:
    the study and variant under bench/results, e.g. swap_step_time/small."""
    path = os.path.join(ROOT, RESULTS, folder, "summary.md")
    if not os.path.exists(path):
        return [f"(no {folder} rows yet: `{command}`)"]
    with open(path) as f:
        lines = f.read().strip().splitlines()
    lines[0] = "**" + lines[0].lstrip("# ") + f"** (`{command}`, rows in `bench/results/{folder}/rows.jsonl`)"
    return lines


def step_time_section():
    return [
        *summary_md("swap_step_time/tiny", "python bench/swap_step_time.py"),
        "",
        *summary_md(
            "swap_step_time/small",
            "python bench/swap_step_time.py --model small --budget-fraction 0.4 "
            "--repeats 3 --steps 10 --out bench/results/swap_step_time/small",
        ),
        "",
        *summary_md(
            "swap_step_time/tiny-moe",
            "python bench/swap_step_time.py --model tiny-moe --repeats 3 --steps 8 "
            "--out bench/results/swap_step_time/tiny-moe",
        ),
        "",
        *summary_md(
            "swap_step_time/tinyllama-1.1b",
            "python bench/swap_step_time.py --model tinyllama-1.1b --seq-len 128 --micro-batch 1 "
            "--budget-fraction 0.125 --backends zero_infinity_eqmem,aidaptiv --repeats 2 --steps 3 --warmup 1 "
            "--out bench/results/swap_step_time/tinyllama-1.1b",
        ),
        "",
        *summary_md(
            "swap_step_time/qwen2.5-3b",
            "python bench/swap_step_time.py --model qwen2.5-3b --backends aidaptiv --budget-fraction 0.0696 "
            "--seq-len 128 --micro-batch 1 --steps 5 --warmup 2 --repeats 2 --out bench/results/swap_step_time/qwen2.5-3b",
        ),
        "",
        *summary_md(
            "swap_step_time/qwen2.5-3b_eighth",
            "python bench/swap_step_time.py --model qwen2.5-3b --backends aidaptiv --budget-fraction 0.125 "
            "--seq-len 128 --micro-batch 1 --steps 5 --warmup 2 --repeats 1 --out bench/results/swap_step_time/qwen2.5-3b_eighth",
        ),
        "",
        *summary_md("heap_settings/tiny", "python bench/heap_settings.py"),
        "",
        *summary_md(
            "heap_settings/small",
            "python bench/heap_settings.py --model small --budget-fraction 0.4 "
            "--variants 1MiB,128KiB --steps 10 --out bench/results/heap_settings/small",
        ),
    ]


def generate_section():
    return [
        *summary_md("long_sequence/tiny", "python bench/long_sequence.py"),
        "",
        *summary_md(
            "generate_offload/tinyllama-1.1b_fp32",
            "python bench/generate_offload.py --cap-gib 2 --kv-prefix 0 --repeats 3 --sides "
            "aidaptiv,aidaptiv_encode_on,accelerate, then --cap-gib 2 --kv-only",
        ),
        "",
        *summary_md(
            "generate_offload/tinyllama-1.1b_bf16",
            "python bench/generate_offload.py --dtype bfloat16 --budget 512MiB --cap-gib 1.5 --kv-prefix 0 --repeats 3 "
            "--sides aidaptiv,aidaptiv_encode_off,accelerate --out bench/results/generate_offload/tinyllama-1.1b_bf16",
        ),
        "",
        *summary_md(
            "generate_offload/qwen2.5-3b_bf16",
            "python bench/generate_offload.py --shape qwen2.5-3b --dtype bfloat16 --budget 1GiB --cap-gib 2 "
            "--kv-prefix 0 --repeats 3 --sides aidaptiv,aidaptiv_encode_off,accelerate --out "
            "bench/results/generate_offload/qwen2.5-3b_bf16",
        ),
        "",
        *summary_md(
            "generate_offload/tinyllama-1.1b_fp32_zero_inference",
            "python bench/generate_offload.py --cap-gib 4 --kv-prefix 0 --repeats 2 --sides aidaptiv,zero_inference "
            "--out bench/results/generate_offload/tinyllama-1.1b_fp32_zero_inference",
        ),
        "",
        *summary_md(
            "generate_moe/olmoe-1b-7b_bfloat16",
            "python bench/generate_moe.py --shape olmoe-1b-7b --budget 2GiB --cap-gib 4 --repeats 2 "
            "--sides aidaptiv,aidaptiv_whole,accelerate --before f3af159 --routers uniform,zipf",
        ),
        "",
        *summary_md(
            "generate_moe/qwen3-30b-a3b_bfloat16",
            "python bench/generate_moe.py --shape qwen3-30b-a3b --budget 4GiB --cap-gib 6 --repeats 2 --sides "
            "aidaptiv --routers uniform,zipf --no-in-memory --new-tokens 16 --note ...",
        ),
        "",
        *summary_md("io_order/2core_vm", "python bench/io_order.py"),
    ]


def sweep_section():
    from aidaptiv_ds.harness.machine import cpu_line
    from aidaptiv_ds.harness.results import load_rows

    out_dir = os.path.join(ROOT, RESULTS, "cpu_small", "xeon")
    if not os.path.exists(os.path.join(out_dir, "results.jsonl")):
        return [
            "(no sweep rows yet: `python bench/sweep_grid.py --grid bench/grids/cpu_small.json --out bench/results/cpu_small/xeon`)"
        ]
    rows = {}
    for r in load_rows(out_dir).rows:  # the newest row of each cell
        rows[(r["model"], r["gpus"], r["micro_batch"], r["seq_len"], r["backend"])] = r
    backends = ["zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv"]
    shapes = sorted(
        {k[:4] for k in rows},
        key=lambda k: (["micro", "tiny", "small"].index(k[0]) if k[0] in ("micro", "tiny", "small") else 9, k[1:]),
    )
    any_row = next(iter(rows.values()))
    cap = (any_row.get("host_mem_cap") or {}).get("gb")
    m = any_row.get("machine", {})
    out = [
        f"**CPU sweep** (`bench/grids/cpu_small.json`, report in `bench/results/cpu_small/xeon/report.md`): tokens/s "
        f"per cell, {cpu_line(m)}, {m.get('cores', '?')} cores, host memory capped at "
        f"{cap} GiB per cell (cgroup), fp32, median step after warm-up; OOM: killed by the cap.",
        "",
        "| model | processes | batch x seq | " + " | ".join(backends) + " |",
        "|---|---|---|" + "---|" * len(backends),
    ]
    ratios = []
    for shape in shapes:
        cells = []
        for b in backends:
            r = rows.get(shape + (b,))
            if r is None:
                cells.append("-")
            elif r["status"] == "ok":
                cells.append(f"{r['tokens_per_s']:.0f}")
            else:
                cells.append(r["status"].upper() + ("*" if r.get("inferred") else ""))
        a, z = rows.get(shape + ("aidaptiv",)), rows.get(shape + ("zero_infinity",))
        if a and z and a["status"] == z["status"] == "ok":
            ratios.append(a["tokens_per_s"] / z["tokens_per_s"])
        out.append(f"| {shape[0]} | {shape[1]} | {shape[2]} x {shape[3]} | " + " | ".join(cells) + " |")
    if ratios:
        out += [
            "",
            f"aidaptiv / ZeRO-Infinity tokens/s over the {len(ratios)} cells both ran: median "
            f"**{statistics.median(ratios):.2f}x** (min {min(ratios):.2f}x, max {max(ratios):.2f}x).",
        ]
    only = [
        s
        for s in shapes
        if (rows.get(s + ("aidaptiv",)) or {}).get("status") == "ok"
        and (rows.get(s + ("zero_infinity",)) or {}).get("status") != "ok"
    ]
    if only:
        out.append("Cells only aidaptiv ran: " + ", ".join(f"{s[0]} {s[2]}x{s[3]} on {s[1]}" for s in only) + ".")
    return out


def capacity_section():
    return [
        *summary_md("capacity_models/cap_8gib", "python bench/capacity_models.py"),
        "",
        *summary_md(
            "capacity_models/moe_cap_8gib",
            "python bench/capacity_models.py --models tiny-moe,small-moe,medium-moe,olmoe-1b-7b "
            "--out bench/results/capacity_models/moe_cap_8gib",
        ),
        "",
        *summary_md("capacity_seq_len/cap_5gib", "python bench/capacity_seq_len.py"),
    ]


def lora_section():
    """bench/lora_memory.py's table for a base larger than the host budget (its summary.md has no title)."""
    path = os.path.join(ROOT, RESULTS, "lora_memory", "tinyllama-1.1b", "summary.md")
    if not os.path.exists(path):
        return ["(no lora_memory/tinyllama-1.1b rows yet: `python bench/lora_memory.py --model tinyllama-1.1b ...`)"]
    with open(path) as f:
        body = f.read().strip().splitlines()
    return [
        "**LoRA on a base larger than the host budget** (tinyllama-1.1b's 4.4 GB of fp32 weights, a 1 GiB budget; "
        "rows in `bench/results/lora_memory/tinyllama-1.1b/rows.jsonl`). The base is only read: at most once for the forward and once "
        "for the backward, 8.8 GB a step.",
        "",
        *body,
    ]


def documents_section():
    """bench/documents_qa.py: a real instruct model before and after fine-tuning on an invented document set."""
    path = os.path.join(ROOT, RESULTS, "documents_qa", "smollm2-135m", "rows.jsonl")
    rows = _rows(path) if os.path.exists(path) else []
    if not rows:
        return ["(no documents_qa rows yet: `python bench/documents_qa.py --model $(bash scripts/real_model.sh)`)"]
    base = rows[0]["base"]
    out = [
        "### Documents to a model that knows them",
        "",
        f"SmolLM2-135M-Instruct (its GGUF from the package index) fine-tuned through `aidaptiv-ds train` with the "
        f"aidaptiv block on 16 facts about an invented archipelago (`bench/documents_qa/`: two phrasings of a "
        f"question about each fact), then asked a third phrasing of each, greedy, through its chat template. "
        f"Exact match: the reply contains the fact's answer; answer loss: the mean NLL of the fact's sentence after "
        f"the held-out question. Machine: {rows[0]['machine']}. `{('python bench/documents_qa.py ' + rows[0]['args']).strip()}` "
        f"(every reply in `bench/results/documents_qa/smollm2-135m/summary.md`).",
        "",
        "| model | exact match (of 16) | answer loss | steps | train wall | precision |",
        "|---|---|---|---|---|---|",
        f"| base | {base['exact_match']} | {base['answer_loss']:.3f} | | | |",
    ]
    for r in rows:
        a, t = r["after"], r["train"]
        what = "LoRA r=16, every linear layer" if t.get("lora") else "full fine-tune"
        out.append(
            f"| {what}, {r['epochs']:g} epochs | {a['exact_match']} | {a['answer_loss']:.3f} | {t['steps']} | "
            f"{t['wall_s']:.0f} s | {t['dtype']} |"
        )
    return out


def serving_section():
    """bench/serve_clients.py (`serve` under concurrent clients) and bench/gguf_llamacpp.py (the GGUF export read
    by llama.cpp itself), each from its own summary."""
    return [
        "### Serving the fine-tuned model: the OpenAI API and GGUF",
        "",
        *summary_md(
            "serve_clients/smollm2-135m",
            "python bench/serve_clients.py --model MODEL --out bench/results/serve_clients/smollm2-135m",
        ),
        "",
        *summary_md("gguf_llamacpp/smollm2-135m", "python bench/gguf_llamacpp.py --model MODEL"),
    ]


def step_regression_section():
    """bench/step_regression.py: the train job's step before and after a change, from its summary."""
    return [
        "### The step before and after a refactor",
        "",
        *summary_md("step_regression/tiny", "python bench/step_regression.py --baseline REV"),
    ]


def cluster_section():
    """bench/cluster_network.py: two nodes of the real SLURM cluster against two ranks on one node, and the plan
    of the two-node cell against what it used, from its summary."""
    return [
        "### More than one node: the network path and the plan per node",
        "",
        *summary_md("cluster_network/tiny", "python bench/cluster_network.py"),
    ]


def gpu_section():
    """Every GPU sweep, bench/results/gpu_*/<variant>/: its device, what its cells did, and where cells ran, the report's
    Table VI-shaped throughput tables, aidaptiv's ratios and the Table VI comparison in model FLOP/s."""
    import glob
    from collections import Counter

    from aidaptiv_ds.harness import report_studies, report_tables
    from aidaptiv_ds.harness.results import load_rows

    out = []
    for out_dir in sorted(glob.glob(os.path.join(ROOT, RESULTS, "gpu_*", "*"))):
        loaded = load_rows(out_dir)
        if not loaded.rows:
            continue
        rows = report_tables.cell_summaries(loaded.rows)
        name = os.path.relpath(out_dir, ROOT)
        gpus = (rows[0].get("machine") or {}).get("gpus") or [{}]
        dev = f"{gpus[0].get('name', 'unknown GPU')} ({(gpus[0].get('memory_mb') or 0) / 1024:.0f} GiB)"
        caps = sorted({r.get("gpu_mem_cap_gb") for r in rows if r.get("gpu_mem_cap_gb")})
        counts = Counter(r["status"] for r in rows)
        out += [
            f"**GPU sweep `{name}`** ({rows[0].get('grid')}, on {dev}"
            + (f", GPU memory capped at {', '.join(f'{c:g}' for c in caps)} GB" if caps else "")
            + f"; git {(rows[0].get('git_sha') or '?')[:10]}; report in `{name}/report.md`): {len(rows)} cell(s), "
            + ", ".join(f"{n} {st}" for st, n in sorted(counts.items()))
            + ".",
            "",
        ]
        ok = [r for r in rows if r["status"] == "ok"]
        if os.path.exists(os.path.join(out_dir, "README.md")):
            out += [f"What the session showed, and what the rows cannot say: `{name}/README.md`.", ""]
        # Out-of-memory cells read off the tables; errors need their line. Without an ok cell, every reason.
        errors = sorted(
            {
                (r["backend"], (r.get("error") or "")[:120])
                for r in rows
                if r["status"] != "ok" and (not ok or r["status"] != "oom")
            }
        )
        if errors:
            out += [f"- {b}: {e}" for b, e in errors] + [""]
        if not ok:
            continue
        for model in sorted({r["model"] for r in rows}):
            mrows = [r for r in rows if r["model"] == model]
            table, _ = report_tables.throughput_table(model, mrows)
            out += [f"{model}, tokens/s:", "", table, ""]
            if any(r["backend"] == "aidaptiv" for r in mrows):
                for den in report_tables._others(mrows):
                    rt = report_tables.ratios(mrows, "aidaptiv", den)
                    vals = list(rt["both"].values())
                    if vals:
                        out.append(
                            f"aidaptiv / {report_tables.SHORT.get(den, den)}: median {statistics.median(vals):.2f}x "
                            f"over {len(vals)} shared cell(s) ({min(vals):.2f}x-{max(vals):.2f}x); aidaptiv "
                            f"alone ran {len(rt['only_num'])}, {report_tables.SHORT.get(den, den)} alone "
                            f"{len(rt['only_den'])}."
                        )
                out.append("")
        flops = report_studies.table_vi_flops_section(rows)
        if flops:
            out += [flops, ""]
    return out or ["(no GPU sweep rows yet: `bash bench/gpu/device_check.sh` on a GPU machine)"]


def faults_section():
    """The fault-injection table from bench/results/faults/micro/rows.jsonl (bench/faults.py): per case, how many
    runs, and in how many the job hung, crashed, failed without a clear error, or lost data."""
    from aidaptiv_ds.harness.machine import cpu_line

    rows = _rows(os.path.join(ROOT, RESULTS, "faults", "micro", "rows.jsonl"))
    if not rows:
        return ["(no fault-injection rows yet: `python bench/faults.py --runs 3`)"]
    order, by_case = [], {}
    for r in rows:
        if r["case"] not in by_case:
            order.append(r["case"])
        by_case.setdefault(r["case"], []).append(r)
    # The cases ran in sessions on different machines: each machine with the cases it ran.
    machines: dict = {}
    for r in rows:
        m = r.get("machine") or {}
        line = f"{cpu_line(m)}, {m.get('cores', '?')} cores"
        machines.setdefault(line, [])
        if r["case"] not in machines[line]:
            machines[line].append(r["case"])
    where = "; ".join(
        f"{line} ({'every case' if len(machines) == 1 else ', '.join(cs)})" for line, cs in machines.items()
    )
    shas = sorted({r.get("git_sha", "?")[:10] for r in rows})
    out = [
        f"**Fault injection** (`python bench/faults.py`, cases in `tests/faults/cases.py`): {where}; git "
        f"{', '.join(shas)}. Each run is a whole `aidaptiv-ds train` job "
        "(micro preset, fp32, 6 steps, a checkpoint every 2) with the fault in step 4; data lost counts runs "
        "whose last checkpoint did not resume to the uninterrupted losses (1e-6 relative), or whose bytes "
        "differed.",
        "",
        "Clear error: the job's status line names the file, the errno, the offset and what to do; for a fault "
        "the job rides through, its log says what fell back. The checkpoint cases (planted-payload*, flipped-*, "
        "nan-*, damaged-model-states) damage the newest checkpoint of a finished job, then resume it with "
        "`--resume auto` (nan-export: export and generate it): clear error is a refusal that names the file and "
        "what to do, data lost a checkpoint before it that did not resume or export, or a payload that ran.",
        "",
        "| case | fault injected | runs | clear error | hangs | crashes | data lost |",
        "|---|---|---|---|---|---|---|",
    ]
    totals = [0, 0, 0, 0, 0]
    judged = 0  # runs that had an error to give (not killed)
    for case in order:
        rs = by_case[case]
        n = len(rs)
        injected = sum(r.get("injected", 1) for r in rs)
        counts = [
            sum(bool(r["clear_error"]) for r in rs),
            sum(bool(r["hang"]) for r in rs),
            sum(bool(r["crash"]) for r in rs),
            sum(bool(r["data_lost"]) for r in rs),
        ]
        killed = all(r.get("rc") == -9 for r in rs)
        if killed:
            counts[0] = 0
        else:
            judged += n
        totals = [totals[0] + n, *(t + c for t, c in zip(totals[1:], counts))]
        what = rs[-1]["fault"] + (f" ({injected} in all)" if injected != n else "")
        # A job killed by the injected SIGKILL has nothing to say; the others must say it.
        clear = "n/a (SIGKILL)" if killed else f"{counts[0]}/{n}"
        out.append(f"| {case} | {what} | {n} | {clear} | {counts[1]} | {counts[2]} | {counts[3]} |")
    out.append(f"| **all** | | {totals[0]} | {totals[1]}/{judged} | {totals[2]} | {totals[3]} | **{totals[4]}** |")
    return out


def settings_section():
    """The block's settings, from the pydantic model (so docs/USAGE.md cannot drift from the code)."""
    from aidaptiv_ds.config.schema import AidaptivConfig

    out = ["| setting | default | meaning |", "|---|---|---|"]
    for name, field in AidaptivConfig.model_fields.items():
        nested = getattr(field.annotation, "model_fields", None)
        if nested is not None:  # an object of settings (activations): one row per setting inside it
            for sub, sub_field in nested.items():
                out.append(f"| `{name}.{sub}` | `{json.dumps(sub_field.default)}` | {sub_field.description} |")
            continue
        default = field.default.value if hasattr(field.default, "value") else field.default
        out.append(f"| `{name}` | `{json.dumps(default)}` | {field.description} |")
    return "\n".join([SETTINGS_BEGIN, "", *out, "", SETTINGS_END])


REPEATS_DIR = os.path.join(RESULTS, "cpu_small_repeats", "epyc")
REPEATS_BACKENDS = ["zero_infinity", "zero_infinity_eqmem", "aidaptiv"]


def repeats_section():
    """bench/grids/cpu_small_repeats.json: per shape and backend the median tokens/s over the repeats with their
    min-max, and aidaptiv / equal-memory ZeRO-Infinity per repeat (repeat k against repeat k: they ran minutes
    apart, the grid interleaves every cell once per repeat)."""
    from aidaptiv_ds.harness.machine import cpu_line
    from aidaptiv_ds.harness.results import load_rows

    out_dir = os.path.join(ROOT, REPEATS_DIR)
    if not os.path.exists(os.path.join(out_dir, "results.jsonl")):
        return [
            f"(no repeated sweep rows yet: `aidaptiv-ds sweep --grid bench/grids/cpu_small_repeats.json --out "
            f"{REPEATS_DIR}`)"
        ]
    runs = {}
    for r in load_rows(out_dir).rows:  # the newest row of each run (cell and repeat)
        runs[(r["model"], r["gpus"], r["micro_batch"], r["seq_len"], r["backend"], r.get("repeat", 0))] = r
    shapes = sorted(
        {k[:4] for k in runs},
        key=lambda k: (["micro", "tiny", "small"].index(k[0]) if k[0] in ("micro", "tiny", "small") else 9, k[1:]),
    )
    repeats = sorted({k[5] for k in runs})
    any_row = next(iter(runs.values()))
    cap = (any_row.get("host_mem_cap") or {}).get("gb")
    m = any_row.get("machine", {})
    names = {
        "zero_infinity": "ZeRO-Infinity (shipped)",
        "zero_infinity_eqmem": "ZeRO-Infinity (aidaptiv's memory)",
        "aidaptiv": "aidaptiv",
    }
    out = [
        f"**CPU sweep, {len(repeats)} interleaved repeats** (`bench/grids/cpu_small_repeats.json`, report in "
        f"`{REPEATS_DIR}/report.md`): tokens/s per cell, median over the repeats (min-max), {cpu_line(m)}, "
        f"{m.get('cores', '?')} cores, host memory capped at {cap} GiB per cell, fp32, 1 process. aidaptiv's host "
        "budget is 0.6 of tiny's state and 0.4 of small's; the eqmem column is ZeRO-Infinity given that same "
        "memory (max_in_cpu, swap buffers, sub-group size; see the grid's notes). OOM*: refused by the launch "
        "guard's plan before training.",
        "",
        "| model | batch x seq | "
        + " | ".join(names[b] for b in REPEATS_BACKENDS)
        + " | aidaptiv / eqmem tokens/s (per-repeat min-max) | peak RSS aidaptiv / eqmem |",
        "|---|---|" + "---|" * (len(REPEATS_BACKENDS) + 2),
    ]
    all_ratios, rss_ratios, shared = [], [], 0
    for shape in shapes:
        cells = []
        for b in REPEATS_BACKENDS:
            got = [runs.get(shape + (b, k)) for k in repeats]
            ok = [r["tokens_per_s"] for r in got if r and r["status"] == "ok"]
            if ok:
                cells.append(
                    f"{statistics.median(ok):.0f} ({min(ok):.0f}-{max(ok):.0f})"
                    + (f", {len(ok)}/{len([r for r in got if r])} ok" if len(ok) < len([r for r in got if r]) else "")
                )
            else:
                bad = next((r for r in got if r), None)
                cells.append("-" if bad is None else bad["status"].upper() + ("*" if bad.get("inferred") else ""))
        pairs = [(runs.get(shape + ("aidaptiv", k)), runs.get(shape + ("zero_infinity_eqmem", k))) for k in repeats]
        pairs = [(a, z) for a, z in pairs if a and z and a["status"] == z["status"] == "ok"]
        ratios = [a["tokens_per_s"] / z["tokens_per_s"] for a, z in pairs]
        rss = [a["peak_rss_mb"] / z["peak_rss_mb"] for a, z in pairs if a.get("peak_rss_mb") and z.get("peak_rss_mb")]
        all_ratios += ratios
        rss_ratios += rss
        shared += bool(ratios)
        ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        rss_cell = f"{statistics.median(rss):.2f}x" if rss else "-"
        out.append(f"| {shape[0]} | {shape[2]} x {shape[3]} | " + " | ".join(cells) + f" | {ratio} | {rss_cell} |")
    if all_ratios:
        out += [
            "",
            f"aidaptiv / ZeRO-Infinity at equal memory over the {shared} shared cells ({len(all_ratios)} "
            f"repeat pairs): tokens/s median **{statistics.median(all_ratios):.2f}x** (min "
            f"{min(all_ratios):.2f}x, max {max(all_ratios):.2f}x), i.e. step time "
            f"{1 / statistics.median(all_ratios):.2f}x; peak RSS median {statistics.median(rss_ratios):.2f}x.",
        ]
    return out


def user_paths_section():
    """bench/user_paths.py: step time per path users take and backend (median over repeats, min-max), and
    aidaptiv / ZeRO-Infinity per path from each repeat's two runs (shipped, and at aidaptiv's memory)."""
    from train_run import paired_ratios  # bench/, on sys.path as this script's folder
    from user_paths import EQMEM, STATE_BYTES_PER_PARAM, path_figures

    from aidaptiv_ds.harness.machine import cpu_line

    rows = [r for r in _rows(os.path.join(ROOT, RESULTS, "user_paths", "tiny", "rows.jsonl")) if r["status"] == "ok"]
    if not rows:
        return ["(no user-path rows yet: `python bench/user_paths.py`)"]
    paths = [p for p in ("script", "trainer", "train") if any(r["path"] == p for r in rows)]
    backends = [b for b in ("aidaptiv", "zero_infinity", EQMEM, "zero3") if any(r["backend"] == b for r in rows)]
    dens = [b for b in ("zero_infinity", EQMEM) if b in backends]
    first = rows[0]
    m = first["machine"]
    budget = next((r["budget_bytes"] for r in rows if r["backend"] == "aidaptiv" and r.get("budget_bytes")), None)
    memory = "ZeRO-Infinity runs its shipped config (no RAM cache, `max_in_cpu: 0`, and its own pinned buffers); " + (
        f"{EQMEM} is that config with its RAM cache, swap buffers and sub-groups sized to aidaptiv's "
        "budget (bench/train_run.eqmem_sizing, as the sweep sizes it)."
        if EQMEM in backends
        else "the memory is not equal here (the repeated sweep below compares at equal memory)."
    )
    out = [
        f"**Step time on the paths users take** (`bench/user_paths.py`, summary in "
        "`bench/results/user_paths/tiny/summary.md`): "
        f"{first['model']} ({first['params'] / 1e6:.1f}M params), fp32, micro-batch {first['micro_batch']} x seq "
        f"{first['seq_len']}, 1 CPU process, {cpu_line(m)}, {m.get('cores', '?')} cores; "
        f"{len({r['repeat'] for r in rows})} interleaved repeats, median step after {first['warmup']} warm-up steps. "
        "script: a plain loop with the model built under `deepspeed.zero.Init` (examples/zero_init_train.py); "
        "trainer: the HF Trainer with `--deepspeed` (examples/hf_trainer_finetune.py); train: `aidaptiv-ds "
        "train`. aidaptiv gets a host budget of "
        + (
            f"{budget / 2**20:.0f} MiB ({budget / (first['params'] * STATE_BYTES_PER_PARAM):.2g} of the model state); "
            if budget
            else "a quarter of the model state; "
        )
        + memory,
        "",
        "| path | "
        + " | ".join(f"{b} step s" for b in backends)
        + " | "
        + " | ".join(f"aidaptiv / {d} step | peak RSS aidaptiv / {d}" for d in dens)
        + " |",
        "|---|" + "---|" * (len(backends) + 2 * len(dens)),
    ]
    for p in paths:
        cells = []
        for b in backends:
            v = [r["step_s_median"] for r in rows if r["path"] == p and r["backend"] == b]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-")
        for d in dens:
            step = paired_ratios(path_figures(rows, p, "step_s_median"), "aidaptiv", d)
            rss = paired_ratios(path_figures(rows, p, "peak_rss_mb"), "aidaptiv", d)
            cells.append(f"{statistics.median(step):.2f}x ({min(step):.2f}-{max(step):.2f})" if step else "-")
            cells.append(f"{statistics.median(rss):.2f}x" if rss else "-")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return out


def section():
    parts = [
        BEGIN,
        "",
        *io_bench_section(),
        "",
        *step_time_section(),
        "",
        *user_paths_section(),
        "",
        *sweep_section(),
        "",
        *repeats_section(),
        "",
        *capacity_section(),
        "",
        *lora_section(),
        "",
        *generate_section(),
        "",
        *documents_section(),
        "",
        *serving_section(),
        "",
        *step_regression_section(),
        "",
        *cluster_section(),
        "",
        *gpu_section(),
        *faults_section(),
        "",
        END,
    ]
    return "\n".join(parts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print", action="store_true")
    args = p.parse_args()
    text = section()
    if args.print:
        print(settings_section() + "\n\n" + text)
        return
    for doc, begin, end_marker, body in (
        (RESULTS_DOC, BEGIN, END, text),
        (SETTINGS_DOC, SETTINGS_BEGIN, SETTINGS_END, settings_section()),
    ):
        _rewrite(os.path.join(ROOT, doc), begin, end_marker, body)


def _rewrite(path, begin, end_marker, body):
    """Replace what lies between (and including) the two markers of the file at path with body."""
    with open(path) as f:
        content = f.read()
    if begin not in content or end_marker not in content:
        raise SystemExit(f"{os.path.relpath(path, ROOT)} has no {begin} ... {end_marker} markers to rewrite")
    start, end = content.index(begin), content.index(end_marker) + len(end_marker)
    with open(path, "w") as f:
        f.write(content[:start] + body + content[end:])


if __name__ == "__main__":
    main()
