#!/usr/bin/env python3
"""Step time on the paths users take: a plain zero.Init script, the Hugging Face Trainer and our train job.

bench/swap_step_time.py measures our train job only. A user reaches the swapper in three ways, and each is
measured here with each backend, interleaved, on the same shape (default `tiny`: 58M parameters, fp32,
micro-batch 2 x sequence 64, one process):

- ``script``: examples/zero_init_train.py, a plain loop a user writes (model built under
  ``deepspeed.zero.Init(config_dict_or_path=config)``, ``deepspeed.initialize``, forward/backward/step on
  random tokens), started with ``python`` from its own working directory;
- ``trainer``: examples/hf_trainer_finetune.py, the Hugging Face Trainer with ``--deepspeed CONFIG`` (the
  model built under zero.Init by transformers), per-step times from a TrainerCallback;
- ``train``: ``aidaptiv-ds train`` (what bench/swap_step_time.py runs).

Backends: ``aidaptiv`` (ds_configs/aidaptiv.json with ``host_memory_budget`` set to --budget-fraction of the
model state, default a quarter, as a user edits it), ``zero_infinity`` (ds_configs/zero_infinity.json, its
documented settings), ``zero_infinity_eqmem`` (the same file with its RAM cache, swap buffers and sub-groups
sized to aidaptiv's host budget, aidaptiv_ds/harness/eqmem.py, as the sweep and bench/swap_step_time.py size
it) and ``zero3`` (in-memory ZeRO-3, the compute-only reference). Each run gets a copy of
the config with its swap folder filled in and nothing else changed.

    python bench/user_paths.py [--repeats 5] [--steps 12] [--paths script,trainer,train] [--out DIR]

Writes one JSON row per run to OUT/rows.jsonl (appended) and OUT/summary.md: per path and backend the
median over repeats of each run's median step time after --warmup, its spread (min-max over repeats), the
aidaptiv / ZeRO-Infinity ratio of each repeat's adjacent pair, and where the swapper's own counters give it
the split of a step: parameter and optimizer I/O wait, engine.step(), and the optimizer updates our swapper
applies inside the next forward (fp32). Every row records the load average before and after the run: this
measures wall time, and on a shared machine the load is part of the result.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from train_run import (  # noqa: E402  (bench/train_run.py)
    add_run_arguments,
    bench_setup,
    eqmem_sizing,
    paired_ratios,
    run_interleaved,
)

from aidaptiv_ds.common.sizes import state_bytes_per_param  # noqa: E402
from aidaptiv_ds.harness import eqmem  # noqa: E402
from aidaptiv_ds.harness.machine import summary  # noqa: E402

PATHS = ("script", "trainer", "train")
EQMEM = eqmem.BACKEND  # ZeRO-Infinity with aidaptiv's host memory
BACKENDS = ("aidaptiv", "zero_infinity", EQMEM, "zero3")
# fp32 ZeRO-3 with the optimizer offloaded keeps, per parameter: the parameter, its gradient, an fp32 master
# and two Adam moments (20 bytes).
STATE_BYTES_PER_PARAM = state_bytes_per_param(4)
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def run_config(backend, swap, args):
    """The shipped config of ``backend`` as a user adapts it: swap folder, and for aidaptiv the host budget;
    zero_infinity_eqmem is ZeRO-Infinity's with its RAM cache and buffers sized to that budget."""
    if backend == EQMEM:
        cfg = eqmem.eqmem_config(*eqmem_sizing(ROOT, args.model, args.budget_bytes))
    else:
        with open(os.path.join(ROOT, "ds_configs", f"{backend}.json")) as f:
            cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    if backend == "aidaptiv":
        cfg["aidaptiv"].update(nvme_path=swap, host_memory_budget=args.budget_bytes)
    zero = cfg.get("zero_optimization") or {}
    for section in ("offload_param", "offload_optimizer"):
        if isinstance(zero.get(section), dict) and "nvme_path" in zero[section]:
            zero[section]["nvme_path"] = os.path.join(swap, "zero_infinity")
    path = os.path.join(swap, f"{backend}.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def command(path, backend, cfg, swap, out, args):
    if path == "script":
        c = args.shape
        return [
            sys.executable,
            os.path.join(ROOT, "examples", "zero_init_train.py"),
            "--config",
            cfg,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--seq-len",
            str(args.seq_len),
            "--hidden",
            str(c.hidden_size),
            "--layers",
            str(c.num_hidden_layers),
            "--heads",
            str(c.num_attention_heads),
            "--kv-heads",
            str(c.num_key_value_heads),
            "--intermediate",
            str(c.intermediate_size),
            "--vocab",
            str(c.vocab_size),
            "--json-out",
            out,
        ]
    if path == "trainer":
        with open(cfg) as f:
            lr = json.load(f)["optimizer"]["params"]["lr"]
        # The shipped configs give numbers, which the Trainer requires TrainingArguments to match.
        return [
            sys.executable,
            os.path.join(ROOT, "examples", "hf_trainer_finetune.py"),
            "--deepspeed",
            cfg,
            "--model",
            args.model,
            "--seq_len",
            str(args.seq_len),
            "--output_dir",
            os.path.join(swap, "out"),
            "--max_steps",
            str(args.steps),
            "--per_device_train_batch_size",
            str(args.micro_batch),
            "--learning_rate",
            str(lr),
            "--weight_decay",
            "0.0",
            "--max_grad_norm",
            "1.0",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--logging_steps",
            "1",
            "--step_times_out",
            out,
        ]
    return [
        sys.executable,
        "-m",
        "aidaptiv_ds",
        "train",
        "--config",
        cfg,
        "--model",
        args.model,
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--nvme-path",
        swap,
        "--metrics-out",
        out,
        "--no-progress",
    ]


def _med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _timed(values, warmup):
    values = list(values or [])
    return values[warmup:] if len(values) > warmup else values


def normalise(path, record, warmup):
    """One run's figures, the same names for every path; what a path does not measure is None."""
    if path == "train":
        m = record
        ph = m.get("phases_s") or {}
        bytes_steps = m.get("nvme_bytes_steps") or 0
        return {
            "step_s_median": m.get("step_s_median"),
            "step_s": m.get("step_s"),
            "losses": m.get("losses"),
            "forward_s": ph.get("forward"),
            "backward_s": ph.get("backward"),
            "step_call_s": ph.get("optimizer"),
            "update_s": ph.get("optimizer_update"),
            "io_wait_s": ph.get("io_wait"),
            "read_mb_step": m["nvme_read_bytes"] / bytes_steps / 1e6
            if bytes_steps and m.get("nvme_read_bytes") is not None
            else None,
            "write_mb_step": m["nvme_write_bytes"] / bytes_steps / 1e6
            if bytes_steps and m.get("nvme_write_bytes") is not None
            else None,
            "peak_rss_mb": m.get("peak_rss_mb"),
            "peak_pinned_mb": m.get("peak_pinned_mb"),
            "swapper": m.get("swapper"),
        }
    stats = record.get("aidaptiv_stats")
    steps = record.get("steps")
    if steps is not None:  # the script: phases of every step
        step_s = [s["step_s"] for s in steps]
        timed = _timed(steps, warmup)
        forward, backward, step_call = (_med([s[k] for s in timed]) for k in ("forward", "backward", "optimizer"))
        io = record.get("io_bytes")
        n = record.get("io_steps")
        read, write = (io[0] / n / 1e6, io[1] / n / 1e6) if io and n else (None, None)
    else:  # the Trainer: whole steps only; bytes from the end of the warm-up to the end
        step_s = record.get("step_s") or []
        forward = backward = step_call = None
        marks = record.get("io_bytes_at_step_end") or []
        read = write = None
        if len(marks) > warmup >= 1 and marks[warmup - 1] and marks[-1]:
            n = len(marks) - warmup
            read, write = ((marks[-1][i] - marks[warmup - 1][i]) / n / 1e6 for i in (0, 1))
    out = {
        "step_s_median": _med(_timed(step_s, warmup)),
        "step_s": step_s,
        "losses": record.get("losses"),
        "forward_s": forward,
        "backward_s": backward,
        "step_call_s": step_call,
        "update_s": None,
        "io_wait_s": None,
        "read_mb_step": read,
        "write_mb_step": write,
        "peak_rss_mb": record.get("peak_rss_mb"),
        "peak_pinned_mb": None,
        "swapper": None,
    }
    if stats:
        out["io_wait_s"] = _med(_timed(stats.get("io_wait_s"), warmup))
        out["update_s"] = _med(_timed(stats.get("optimizer_apply_s_steps"), warmup))
        out["peak_pinned_mb"] = (stats.get("peak_pinned_bytes") or 0) / 2**20
        out["swapper"] = {k: v for k, v in stats.items() if not isinstance(v, (list, tuple, dict))}
    return out


def run_one(path, backend, args, env):
    swap = tempfile.mkdtemp(prefix=f"{path}-{backend}-", dir=args.swap_root)
    out = os.path.join(swap, "record.json")
    cfg = run_config(backend, swap, args)
    cmd = command(path, backend, cfg, swap, out, args)
    child = {k: v for k, v in env.items() if k not in RANK_ENV}
    if path == "trainer":  # the rendezvous a launcher would give a 1-process job
        from aidaptiv_ds.job.rank_env import _free_port

        child.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    load0 = os.getloadavg()
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=swap, env=child, capture_output=True, text=True)
    row = {
        "path": path,
        "backend": backend,
        "returncode": proc.returncode,
        "wall_s": time.time() - t0,
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "command": cmd,
    }
    record = None
    if os.path.exists(out):
        with open(out) as f:
            record = json.load(f)
    if proc.returncode == 0 and record is not None and record.get("status", "ok") == "ok":
        row.update(status="ok", **normalise(path, record, args.warmup))
    else:
        row.update(
            status="error",
            error=(
                (record or {}).get("error") or ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
            ),
        )
    shutil.rmtree(swap, ignore_errors=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, 5, "runs per path and backend")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated paths (default {','.join(PATHS)})")
    p.add_argument(
        "--backends", default=",".join(BACKENDS), help=f"comma-separated backends (default {','.join(BACKENDS)})"
    )
    p.add_argument("--swap-root", default=os.path.join(ROOT, "swap"), help="where swap folders are made")
    p.add_argument(
        "--out",
        help="folder for rows.jsonl and summary.md (default bench/results/user_paths/<model>)",
    )
    args = p.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "user_paths", args.model)
    paths, backends = args.paths.split(","), args.backends.split(",")
    problems = [f"unknown path {x!r} (choose from {', '.join(PATHS)})" for x in paths if x not in PATHS]
    problems += [f"unknown backend {x!r} (choose from {', '.join(BACKENDS)})" for x in backends if x not in BACKENDS]
    if not 0 <= args.warmup < args.steps:
        problems.append(f"--warmup {args.warmup} must be at least 0 and below --steps {args.steps}")
    if problems:
        p.error("; ".join(problems))

    from aidaptiv_ds.models.presets import count_parameters, preset_config

    args.shape = preset_config(args.model)
    params = count_parameters(args.shape)
    args.budget_bytes = int(params * STATE_BYTES_PER_PARAM * args.budget_fraction)
    args.swap_root = os.path.abspath(args.swap_root)
    env, machine, sha, dirty = bench_setup(ROOT, args.swap_root, args.out)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # the examples import aidaptiv_ds
    print(summary(machine), file=sys.stderr)
    print(
        f"model {args.model}: {params / 1e6:.2f}M parameters, state {params * STATE_BYTES_PER_PARAM / 2**20:.0f} MiB,"
        f" aidaptiv host budget {args.budget_bytes / 2**20:.0f} MiB",
        file=sys.stderr,
    )
    # Every (path, backend) pair in turn, the whole order reversed every other repeat (paths and backends both).
    names = [f"{path}/{backend}" for path in paths for backend in backends]
    common = dict(
        git_sha=sha,
        git_dirty=dirty,
        machine=machine,
        model=args.model,
        params=params,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        steps=args.steps,
        warmup=args.warmup,
    )
    rows = run_interleaved(
        names,
        args.repeats,
        lambda name: run_one(*name.split("/"), args, env),
        os.path.join(args.out, "rows.jsonl"),
        common,
        per_name=lambda name: {
            "budget_bytes": args.budget_bytes if name.endswith(("/aidaptiv", "/" + EQMEM)) else None
        },
    )
    text = summarize(rows, args, params, machine, sha, paths, backends)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)


def _fmt(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"


def path_figures(rows, path, key):
    """{(backend, repeat): value} of one path's runs that went ok (train_run.paired_ratios takes it)."""
    return {
        (r["backend"], r["repeat"]): r[key]
        for r in rows
        if r["status"] == "ok" and r["path"] == path and r.get(key) is not None
    }


def summarize(rows, args, params, machine, sha, paths, backends):
    ok = [r for r in rows if r["status"] == "ok"]

    def values(path, backend, key):
        return [r[key] for r in ok if r["path"] == path and r["backend"] == backend and r.get(key) is not None]

    def med(path, backend, key):
        return _med(values(path, backend, key))

    loads = [r["loadavg_before"][0] for r in rows] + [r["loadavg_after"][0] for r in rows]
    lines = [
        f"# Step time on the paths users take, {args.model} ({params / 1e6:.1f}M params), fp32, micro-batch "
        f"{args.micro_batch} x seq {args.seq_len}, 1 process",
        "",
        f"Machine: {summary(machine)}  ",
        f"git {sha}; {args.repeats} interleaved repeats; {args.steps} steps per run, first {args.warmup} "
        f"excluded; aidaptiv host budget {args.budget_bytes / 2**20:.0f} MiB = {args.budget_fraction:g} x model "
        f"state. 1-minute load average during the runs: {min(loads):.1f}-{max(loads):.1f}.",
        "",
        "Step s: median over repeats of each run's median step; spread: min-max of those. The split (medians): "
        "engine.step() s, optimizer updates our swapper applies inside the next forward (fp32), and the "
        "step's wait for parameter and optimizer I/O, from the swapper's counters; the Trainer gives whole "
        "steps only.",
        "",
        "| path | backend | runs ok | step s | spread s | forward s | backward s | engine.step() s | "
        "deferred updates s | I/O wait s | NVMe read MB/step | NVMe write MB/step | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        for b in backends:
            runs = values(path, b, "step_s_median")
            spread = f"{min(runs):.3f}-{max(runs):.3f}" if runs else "-"
            lines.append(
                f"| {path} | {b} | {len(runs)}/{sum(1 for r in rows if r['path'] == path and r['backend'] == b)}"
                f" | {_fmt(_med(runs))} | {spread} | {_fmt(med(path, b, 'forward_s'))} | "
                f"{_fmt(med(path, b, 'backward_s'))} | {_fmt(med(path, b, 'step_call_s'))} | "
                f"{_fmt(med(path, b, 'update_s'))} | {_fmt(med(path, b, 'io_wait_s'))} | "
                f"{_fmt(med(path, b, 'read_mb_step'), 0)} | {_fmt(med(path, b, 'write_mb_step'), 0)} | "
                f"{_fmt(med(path, b, 'peak_rss_mb'), 0)} |"
            )
    others = [b for b in ("zero_infinity", EQMEM, "zero3") if b in backends]
    lines += [
        "",
        "aidaptiv / other backend, per path: the ratio of each repeat's two runs (adjacent in time), "
        "median and range over repeats.",
        "",
        "| path | " + " | ".join(f"vs {b}" for b in others) + " |",
        "|---|" + "---|" * len(others),
    ]
    for path in paths:
        cells = []
        for other in others:
            ratios = paired_ratios(path_figures(rows, path, "step_s_median"), "aidaptiv", other)
            cells.append(
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs)"
                if ratios
                else "-"
            )
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    facts = [(r["path"], r["swapper"]) for r in ok if r["backend"] == "aidaptiv" and r.get("swapper")]
    if facts:
        lines += [
            "",
            "What the swapper did on each path (first run): its plan, layer-group reads, prefetches, "
            "reads DeepSpeed asked for before the prefetch finished.",
            "",
        ]
        seen = set()
        for path, s in facts:
            if path in seen:
                continue
            seen.add(path)
            lines.append(
                f"- {path}: {s.get('plan')}; {s.get('group_reads')} group reads, {s.get('prefetched_groups')} "
                f"prefetched, {s.get('group_hits')} hits, {s.get('sync_param_reads')} synchronous reads"
            )
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "Failed runs:", ""] + [
            f"- repeat {r['repeat']} {r['path']} {r['backend']}: {r.get('error')}" for r in failed
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
