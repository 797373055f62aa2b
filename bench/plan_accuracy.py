"""Hold the planner to the truth: its feasibility, peak host memory and tokens/s against every committed sweep row.

    python bench/plan_accuracy.py                       # rates measured here (cached), rows of bench/results/*
    python bench/plan_accuracy.py --rates rates.json    # rates from a file (as written by an earlier run)

For each row of ``bench/results/<study>/<variant>/results.jsonl`` of the sweeps in ``SWEEPS`` and of the row files in
``EXTRA`` (rows the sweep inferred without running, and rows of code since changed (``STALE_AIDAPTIV``), are left
out), the plan is made for the row's cell on the row's hardware: its host-memory cap per node, training on
CPU unless the row has GPUs, the same aidaptiv host budget, this machine's rates (the rows were measured on it;
``--rates`` gives others). Compared: feasibility (the row's status ok/oom against the plan's fits), predicted
peak host memory per rank against the row's ``peak_rss_mb`` (the largest rank's peak RSS), predicted
tokens/s against the measured, and NVMe bytes per step where the timed steps are steady ones. Writes
``bench/results/plan_accuracy/cpu_sweeps/rows.jsonl`` (one row per cell), ``rates.json`` (the rates used, with how each was
obtained) and ``summary.md`` (fractions and every miss). The issue's targets: feasibility right in >= 95% of
cells; host memory within 15% of >= 80% of ok cells; tokens/s within 30% in >= 80% of the sweeps' ok 1-rank cells
(with more ranks, where collectives are not modelled, a cell may run slower than predicted but not more than
30% faster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from aidaptiv_ds.common.sizes import GiB, MiB  # noqa: E402
from aidaptiv_ds.planner.memory import Hardware, Job, plan_backend  # noqa: E402
from aidaptiv_ds.planner.predict import predict  # noqa: E402
from aidaptiv_ds.planner.rates import RATE_NAMES, Rates  # noqa: E402
from aidaptiv_ds.planner.shapes import resolve_shape  # noqa: E402

HOST_TOLERANCE, TOKENS_TOLERANCE = 0.15, 0.30
OUT = os.path.join(HERE, "results", "plan_accuracy", "cpu_sweeps")
# What the misses come from, as far as they were looked into (docs/DESIGN.md, planner section).
MISS_CAUSES = (
    "Causes. Feasibility: the one miss was planned at 5044 MiB of its 5120 MiB cap (within 1.5%) and "
    "the cap killed it; a cell that close falls either way. Host memory: glibc's heap. Tensors below its 32 MiB "
    "dynamic mmap threshold (every parameter of the tiny model) come from the heap, and what they free there stays "
    "resident: the peak RSS of a 2-rank zero3 tiny run fell from 2323 to 1690 MiB with MALLOC_MMAP_THRESHOLD_ "
    "fixed. DeepSpeed's backends run with glibc's default, and the plan counts a step transient of 10.3 B per "
    "parameter for them on CPU; aidaptiv fixes the threshold (aidaptiv.malloc_mmap_threshold, 1 MiB) and trims the "
    "heap, so its plan counts none (its rows of cpu_small/xeon and cpu_small/epyc predate those settings and are "
    "left out; cpu_small/epyc_aidaptiv_heap re-ran them: 750-933 MiB where they had peaked at 1322-1515), and its 1-rank "
    "cells up to qwen2.5-3b are within 3%. With 2 ranks every gathered parameter is a new whole tensor "
    "(the all-gather output), all of the model at once at the end of the forward under ZeRO-3, the "
    "current and prefetched layer groups under aidaptiv; the plan counts them per rank. Tokens/s: of the 1-rank "
    "cells the NVMe bounds on the rates' machine, zero_infinity's are within 2%, aidaptiv's re-run ones 0 to 30% "
    "faster than predicted (measured a day after the rates, on a disk whose speed varies by day); the cells the CPU bounds "
    "needed ZeRO-3's own work per step (gathering and releasing every parameter, partitioning gradients: the "
    "zero3_cpu rate, from a ZeRO-3 step of the tiny preset less its compute and Adam), without which "
    "they ran 1.3-3x slower than predicted. What is left: CPU-offload's DeepSpeed CPU Adam is faster than the "
    "foreach AdamW the Adam probe times, so its 1-rank cells on the Xeon ran up to 33% faster; the plan gives 2-rank "
    "aidaptiv cells 61-63% more tokens/s than they made (gloo collectives between 2 ranks on 2 cores are not modelled, nor the "
    "page faults of the fixed mmap threshold: the 2 x 4 x 64 cell took 3.42 and 3.74 s a step as shipped against "
    "3.02 and 2.59 s with glibc's dynamic threshold, interleaved, for 841 against 1492-1510 MiB of peak RSS); "
    "ZeRO-3's work is taken as independent of the tokens, which holds within about 25% from 128 to 256 tokens. "
    "At scale (capacity_models) all four ran 30-42% faster than predicted. tinyllama-1.1b's and qwen2.5-3b's "
    "steps are bound by the NVMe: those cells time their second step only, which applies the first update, whose "
    "moments are zeros and are not read (they read 10.8 and 11.8 B a parameter there, a steady step 20), and the "
    "rates here put the disk at 1.2/1.44 GB/s where it measured 1.9-2.4 GB/s the day those rows ran. tiny's and "
    "small's (0 and 1.2 GB read a step) are bound by the CPU; why they beat the CPU term was not looked into."
)


# The sweeps the comparison covers, as <study>/<variant> under bench/results (the rows' "sweep"). Others are added
# deliberately, with a re-run of this script and the committed rows: cpu_small_repeats/epyc repeats cpu_small/epyc's
# shapes and has zero_infinity_eqmem cells, whose config is sized per cell and which the planner does not take as
# a backend; gpu_probe/h200 has no cell that ran (its OOM rows are the planner's to explain once a GPU sweep has ok
# cells too).
SWEEPS = ("cpu_small/xeon", "cpu_small/epyc", "cpu_small/epyc_aidaptiv_heap")
# Rows of a later layout (rows.jsonl), for one backend's full fine-tuning cells only: capacity_models' aidaptiv
# climb from 58M to 3.09B parameters under an 8 GiB cap (its other backends run DeepSpeed's documented buffer
# sizes or eqmem configs, which the planner does not take, and its LoRA cells are not full fine-tuning).
EXTRA = (("capacity_models/cap_8gib", "rows.jsonl", "aidaptiv"),)
# aidaptiv's rows of the first two sweeps measured code without the heap settings (aidaptiv.malloc_mmap_threshold,
# trim_heap), which took 450-750 MiB off those cells' peaks; cpu_small/epyc_aidaptiv_heap re-ran them here with them.
STALE_AIDAPTIV = ("cpu_small/xeon", "cpu_small/epyc")


def load_rows(results_dir: str = os.path.join(HERE, "results")) -> list:
    rows = []
    for name in SWEEPS:
        with open(os.path.join(results_dir, name, "results.jsonl"), encoding="utf-8") as f:
            rows += [
                {**r, "_sweep": name}
                for r in map(json.loads, filter(str.strip, f))
                if not (name in STALE_AIDAPTIV and r.get("backend") == "aidaptiv")
            ]
    for name, file, backend in EXTRA:
        with open(os.path.join(results_dir, name, file), encoding="utf-8") as f:
            rows += [
                {**r, "_sweep": name}
                for r in map(json.loads, filter(str.strip, f))
                if r.get("backend") == backend and not r.get("lora")
            ]
    return [r for r in rows if not r.get("inferred") and r.get("status") in ("ok", "oom")]


def compare(row: dict, rates: Rates) -> dict:
    """The plan for one row's cell beside what the row measured."""
    shape = resolve_shape(row["model"])
    cap = (row.get("host_mem_cap") or {}).get("gb")
    host = int(cap * GiB) if cap else int(row["machine"]["ram_gb"] * GiB)
    gpu_cap = row.get("gpu_mem_cap_gb")
    on_gpu = bool(row["machine"].get("gpus"))
    hw = Hardware(
        gpus=row["gpus"],
        nodes=row.get("nodes") or 1,
        host_mem=host,
        gpu_mem=(int(gpu_cap * GiB) if gpu_cap else None) if on_gpu else None,
        framework_host=int(rates.framework_host or 0),
        # the sweep runs every cell under the deepspeed launcher, inside the cell's memory cap
        launcher_host=int(rates.launcher_host or 0),
    )
    job = Job(
        shape,
        row["seq_len"],
        row["micro_batch"],
        row.get("grad_accum") or 1,
        dtype=row.get("dtype") or "fp32",
        host_budget=row.get("aidaptiv_host_budget_bytes"),
    )
    plan = plan_backend(row["backend"], job, hw)
    pred = predict(plan, job, hw, rates)
    measured_ok = row["status"] == "ok"
    out = {
        "key": row["key"],
        "grid": row.get("grid"),
        "sweep": row.get("_sweep"),
        "ranks": row["gpus"] * (row.get("nodes") or 1),
        "status": row["status"],
        "predicted_fits": plan.fits,
        "feasibility_right": plan.fits == measured_ok,
        "problems": plan.problems,
        "host_predicted_mb": plan.host_bytes / MiB,
        "host_measured_mb": row.get("peak_rss_mb"),
        "tokens_per_s_predicted": pred.tokens_per_s,
        "tokens_per_s_measured": row.get("tokens_per_s"),
        "bound": pred.bound,
        "times_s": pred.times,
    }
    timed = (row.get("steps") or 0) - (row.get("warmup") or 0)
    # The plan's bytes are a steady step's: with warm-up 1 the timed step applies the first update, whose moments
    # are still zeros and are not read (aidaptiv's deferred update applies it in step 2's forward).
    if measured_ok and timed > 0 and (row.get("warmup") or 0) >= 2 and row.get("nvme_read_bytes") is not None:
        # NVMe bytes per step of the node: predicted, and measured over the timed steps (/proc/self/io).
        out["nvme_per_step_predicted"] = {
            "read": pred.bytes.get("nvme_read", 0),
            "write": pred.bytes.get("nvme_write", 0),
        }
        out["nvme_per_step_measured"] = {
            "read": row["nvme_read_bytes"] / timed,
            "write": row["nvme_write_bytes"] / timed,
        }
    if measured_ok and row.get("peak_rss_mb"):
        out["host_error"] = out["host_predicted_mb"] / row["peak_rss_mb"] - 1
    if measured_ok and row.get("tokens_per_s") and pred.tokens_per_s:
        out["tokens_error"] = pred.tokens_per_s / row["tokens_per_s"] - 1
    return out


def rates_cpu(cpu_key_text: str) -> str:
    """The CPU model name inside a rates cache key ("cpu:<model>:<threads>:<dtype>")."""
    parts = cpu_key_text.split(":")
    return ":".join(parts[1:-2]) if len(parts) >= 4 else cpu_key_text


def mark_machines(results: list, rows: list, cpu: str) -> None:
    """Say of each result whether its row was measured on the CPU the rates come from (tokens/s compares
    like with like only then)."""
    for r, row in zip(results, rows):
        r["same_machine"] = (row.get("machine") or {}).get("cpu") == cpu


def summarize(results: list) -> dict:
    """The targets' fractions. Tokens/s: the model leaves collectives between ranks out (predict.py), so such
    cells may run slower than predicted; its target is counted over the sweeps' 1-rank cells, and the cells with
    more ranks are held to the tolerance on the other side only (none more than 30% faster than predicted). The
    at-scale rows (EXTRA) are listed apart: they were not measured beside the rates, on a disk whose speed
    varies by day."""
    ok = [r for r in results if r["status"] == "ok"]
    host = [r for r in ok if "host_error" in r]
    tokens = [r for r in ok if "tokens_error" in r]
    swept = [r for r in tokens if r.get("sweep") in SWEEPS]
    one_rank = [r for r in swept if r.get("ranks", 1) == 1]
    more_ranks = [r for r in swept if r.get("ranks", 1) > 1]
    frac = lambda hits, of: (len(hits) / len(of)) if of else None
    within = lambda rs: [r for r in rs if abs(r["tokens_error"]) <= TOKENS_TOLERANCE]
    same = [r for r in swept if r.get("same_machine")]
    other = [r for r in swept if r.get("same_machine") is False]
    return {
        "tokens_within_30pct_same_machine": frac(within(same), same),
        "tokens_cells_same_machine": len(same),
        "tokens_within_30pct_other_machine": frac(within(other), other),
        "tokens_cells_other_machine": len(other),
        "cells": len(results),
        "ok_cells": len(ok),
        "feasibility_right": frac([r for r in results if r["feasibility_right"]], results),
        "host_within_15pct": frac([r for r in host if abs(r["host_error"]) <= HOST_TOLERANCE], host),
        "tokens_within_30pct": frac(within(one_rank), one_rank),
        "tokens_cells_one_rank": len(one_rank),
        "tokens_within_30pct_all_swept": frac(within(swept), swept),
        "tokens_within_30pct_more_ranks": frac(within(more_ranks), more_ranks),
        "tokens_cells_more_ranks": len(more_ranks),
        "tokens_faster_than_predicted_more_ranks": {
            r["key"]: round(r["tokens_error"], 3) for r in more_ranks if r["tokens_error"] < -TOKENS_TOLERANCE
        },
        "tokens_at_scale": {r["key"]: round(r["tokens_error"], 3) for r in tokens if r.get("sweep") not in SWEEPS},
        "feasibility_misses": [r["key"] for r in results if not r["feasibility_right"]],
        "host_misses": {r["key"]: round(r["host_error"], 3) for r in host if abs(r["host_error"]) > HOST_TOLERANCE},
        "tokens_misses": {
            r["key"]: round(r["tokens_error"], 3) for r in swept if abs(r["tokens_error"]) > TOKENS_TOLERANCE
        },
        "nvme_bytes_error": {
            f"{r.get('sweep')}/{r['key']}": {
                k: round(r["nvme_per_step_predicted"][k] / r["nvme_per_step_measured"][k] - 1, 3)
                for k in ("read", "write")
            }
            for r in ok
            if r.get("nvme_per_step_measured", {}).get("read")
        },
    }


def rates_from(path: str) -> Rates:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rates = Rates()
    for name, entry in data.items():
        if name in RATE_NAMES:
            rates.set(name, entry["value"], entry.get("source") or "given")
    return rates


def markdown(summary: dict, results: list, rates: Rates, conditions: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"
    lines = [
        "# The planner against the committed sweep rows",
        "",
        "Made by `python bench/plan_accuracy.py`; rates used: "
        + "; ".join(f"{k} {v['value']:.4g} {v['unit']} ({v['source']})" for k, v in rates.as_dict().items())
        + ".",
        "",
        f"Rates measured on {conditions['cpu']} (load average {conditions['load_average_1_5_15']} when this was "
        f"made); the rows were measured on {', '.join(conditions['rows_machines'])}. Where these differ, "
        "the tokens/s comparison compares two machines' CPUs and says little about the model.",
        "",
        f"- cells: {summary['cells']} ({summary['ok_cells']} ok)",
        f"- feasibility right: {pct(summary['feasibility_right'])} (target >= 95%)",
        f"- peak host memory within 15%: {pct(summary['host_within_15pct'])} of ok cells (target >= 80%)",
        f"- tokens/s within 30%: {pct(summary['tokens_within_30pct'])} of the sweeps' {summary['tokens_cells_one_rank']} "
        f"ok 1-rank cells (target >= 80%); of all {summary['tokens_cells_same_machine'] + summary['tokens_cells_other_machine']} "
        f"ok sweep cells {pct(summary['tokens_within_30pct_all_swept'])} (rows taken on the rates' machine: "
        f"{pct(summary['tokens_within_30pct_same_machine'])} of {summary['tokens_cells_same_machine']}, on another "
        f"machine: {pct(summary['tokens_within_30pct_other_machine'])} of {summary['tokens_cells_other_machine']}); "
        f"of the {summary['tokens_cells_more_ranks']} with more ranks, where collectives are not modelled (such a "
        f"cell may run slower than predicted), {pct(summary['tokens_within_30pct_more_ranks'])}, and more than 30% "
        "faster than predicted: "
        + (", ".join(f"{k} {v:+.0%}" for k, v in summary["tokens_faster_than_predicted_more_ranks"].items()) or "none"),
        "- tokens/s at scale (capacity_models' aidaptiv cells, 58M-3.09B parameters, measured on 2026-11-27, not "
        "beside these rates; plan / measured - 1): "
        + (", ".join(f"{k} {v:+.0%}" for k, v in summary["tokens_at_scale"].items()) or "none"),
        "- NVMe bytes per step, predicted / measured - 1 (read, write): "
        + (
            ", ".join(f"{k} {v['read']:+.0%} {v['write']:+.0%}" for k, v in summary["nvme_bytes_error"].items())
            or "no cell read from NVMe"
        ),
        "",
        "Feasibility misses: " + (", ".join(summary["feasibility_misses"]) or "none") + ". "
        "Host-memory misses (plan / measured - 1): "
        + (", ".join(f"{k} {v:+.0%}" for k, v in summary["host_misses"].items()) or "none")
        + ". "
        "Tokens/s misses (plan / measured - 1; a key can stand twice, once per sweep): "
        + (
            ", ".join(
                f"{r['key']} {r['tokens_error']:+.0%}"
                for r in results
                if r.get("sweep") in SWEEPS and abs(r.get("tokens_error", 0)) > TOKENS_TOLERANCE
            )
            or "none"
        )
        + ". "
        + MISS_CAUSES,
        "",
        "| sweep | cell | measured | plan fits | host MB plan / measured | tokens/s plan / measured | bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        hm = r["host_measured_mb"]
        tp, tm = r["tokens_per_s_predicted"], r["tokens_per_s_measured"]
        lines.append(
            f"| {r['sweep']} | {r['key']} | {r['status']} | {'yes' if r['predicted_fits'] else 'no'} | "
            f"{r['host_predicted_mb']:.0f} / {hm:.0f} | "
            if hm
            else f"| {r['sweep']} | {r['key']} | {r['status']} | {'yes' if r['predicted_fits'] else 'no'} | "
            f"{r['host_predicted_mb']:.0f} / - | "
        )
        lines[-1] += (f"{tp:.0f} / {tm:.0f} | " if tp and tm else "- | ") + f"{r['bound'] or '-'} |"
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--rates", default=None, help="rates JSON (as written to OUT/rates.json); default: measure here")
    p.add_argument("--nvme", default=HERE, help="directory whose disk the rows' swap space was on (probed)")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    if args.rates:
        rates = rates_from(args.rates)
    else:
        from aidaptiv_ds.planner.rates import machine_rates

        rates = machine_rates("fp32", args.nvme, log=lambda m: print(m, file=sys.stderr))
    rows = load_rows()
    results = [compare(r, rates) for r in rows]
    from aidaptiv_ds.planner.rates import cpu_key

    here = cpu_key("fp32")
    if args.rates:
        with open(args.rates, encoding="utf-8") as f:
            here = (json.load(f).get("conditions") or {}).get("cpu") or here
    mark_machines(results, rows, rates_cpu(here))
    summary = summarize(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rows.jsonl"), "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    from aidaptiv_ds.planner.rates import cpu_key

    conditions = {
        "cpu": cpu_key("fp32"),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "rows_machines": sorted({r["machine"].get("cpu", "?") for r in load_rows()}),
    }
    if args.rates:  # the rates are the file's: so are the conditions they were measured in
        with open(args.rates, encoding="utf-8") as f:
            conditions.update({k: v for k, v in (json.load(f).get("conditions") or {}).items() if k != "rows_machines"})
    with open(os.path.join(args.out, "rates.json"), "w", encoding="utf-8") as f:
        json.dump({**rates.as_dict(), "conditions": conditions}, f, indent=1, sort_keys=True)
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(markdown(summary, results, rates, conditions))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
