#!/usr/bin/env python3
"""Capacity sweep (issue 13): the longest sequence each backend trains under a host memory cap.

For every backend x model x micro-batch, the longest sequence that trains (--steps steps, every loss finite)
on one CPU process under the host cap, found by doubling then bisection over the multiples of 256 up to
--max-seq (aidaptiv_ds/harness/capacity.py). Each attempt is a cell of the sweep harness: the deepspeed
launcher and `aidaptiv-ds train` in their own process tree, in a memory cgroup of --host-mem-cap-gb (else the
RSS watchdog), killed after --timeout-s. An out-of-memory (the cap's kill included) or a timeout is "does
not fit"; so is an error, whose line the summary shows.

Backends at their best settings for long sequences:
- zero3, zero3_cpu_offload, zero_infinity: the shipped ds_configs/<name>.json, with `train
  --gradient-checkpointing` (the Hugging Face model's gradient_checkpointing_enable(use_reentrant=False), as
  the HF Trainer turns it on; DeepSpeed's "activation_checkpointing" section does nothing for an HF model).
  They compute the model's own unchunked loss: the chunked loss is aidaptiv's.
- aidaptiv-nvme / aidaptiv-recompute: ds_configs/aidaptiv.json with aidaptiv.activations.policy nvme
  (block inputs stored in the swap space) or recompute, the loss in chunks of 1024 tokens, and a host budget of
  --aidaptiv-state-fraction of the model's ZeRO-3 state (as the cpu_small grid), inside the cap.

Rows (the sweep's row fields, plus attempt_key, variant, phase, fits) go to OUT/rows.jsonl; a run again with
the same OUT reruns no attempt it has a row for (delete a line to rerun it; rows of other --steps or caps
have other keys). The cells' logs stay in OUT/cells/<variant>__<cell>/. OUT/summary.md gets the table
(longest sequence, tokens/s at it, how it failed above it) and aidaptiv / zero_infinity per model and
micro-batch.

    python bench/capacity_seq_len.py --max-seq 16384,small=8192         # the issue's sweep: hours on a 2-core CPU
    python bench/capacity_seq_len.py --models tiny --micro-batches 1 --variants zero_infinity,aidaptiv-nvme \\
        --max-seq 1024 --host-mem-cap-gb 3 --out /tmp/capacity_check         # a short check
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from aidaptiv_ds.harness import capacity as C  # noqa: E402
from aidaptiv_ds.harness.cellrun import run_cell  # noqa: E402
from aidaptiv_ds.harness.grid import Cell  # noqa: E402
from aidaptiv_ds.harness.hostcap import MECHANISMS, host_cap  # noqa: E402
from aidaptiv_ds.harness.launch import LaunchSpec, free_port, launch_command, train_spec  # noqa: E402
from aidaptiv_ds.harness.outcome import classify  # noqa: E402
from aidaptiv_ds.harness.results import append_row, git_state  # noqa: E402
from aidaptiv_ds.harness.sweep_cell import build_row  # noqa: E402

ROWS_FILE = "rows.jsonl"
STOCK = ("zero3", "zero3_cpu_offload", "zero_infinity")
AIDAPTIV = {"aidaptiv-nvme": "nvme", "aidaptiv-recompute": "recompute"}
VARIANTS = (*STOCK, *AIDAPTIV)
LOSS_CHUNK_TOKENS = 1024


def _list(kind, convert=str, allowed=None):
    def parse(text):
        vals = [convert(x.strip()) for x in text.split(",") if x.strip()]
        bad = [v for v in vals if allowed is not None and v not in allowed]
        if not vals or bad:
            raise argparse.ArgumentTypeError(
                f"{kind} {bad or text!r}: choose from {', '.join(map(str, allowed))}"
                if allowed
                else f"expected a comma list of {kind}"
            )
        return vals

    return parse


def _max_seq(text):
    """'16384' or '16384,small=8192': the longest length tried, and per-model exceptions."""
    default, per_model = None, {}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        name, eq, value = part.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected a length or MODEL=LENGTH")
        if eq:
            per_model[name] = n
        elif default is None:
            default = n
        else:
            raise argparse.ArgumentTypeError(f"{text!r}: one length without a model, then MODEL=LENGTH pairs")
    return (16384 if default is None else default), per_model


def max_seq_of(args, model):
    default, per_model = args.max_seq
    return per_model.get(model, default)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variants",
        type=_list("variant(s)", allowed=VARIANTS),
        default=["zero3", "zero_infinity", "aidaptiv-nvme"],
        help=f"comma list of {', '.join(VARIANTS)} (default zero3,zero_infinity,aidaptiv-nvme)",
    )
    p.add_argument("--models", type=_list("model presets"), default=["tiny", "small"], help="default tiny,small")
    p.add_argument("--micro-batches", type=_list("positive integers", int), default=[1, 2], help="default 1,2")
    p.add_argument(
        "--max-seq",
        type=_max_seq,
        default=(16384, {}),
        help="longest length tried (default 16384); MODEL=N pairs after it set another per model, e.g. "
        "16384,small=8192 (small at 16k tokens takes over half an hour per attempt on 2 cores)",
    )
    p.add_argument(
        "--confirm-seqs",
        type=_list("positive integers", int),
        default=[12000],
        help="lengths off the 256 grid (default 12000, the issue's target on tiny) also run where the "
        "search found a longer length that fits, so that they are measured, not inferred",
    )
    p.add_argument("--steps", type=int, default=2, help="steps per attempt, the first untimed (default 2)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=3600,
        help="per attempt, launcher start-up included; past it the attempt is a timeout, 'does not "
        "fit' (default 3600: tiny at 16k tokens takes minutes per step on 2 cores)",
    )
    p.add_argument(
        "--host-mem-cap-gb", type=float, default=5.0, help="per cell's process tree (default 5, as the cpu_small grid)"
    )
    p.add_argument("--host-mem-cap-mechanism", choices=MECHANISMS, default="auto")
    p.add_argument(
        "--aidaptiv-state-fraction",
        type=float,
        default=0.25,
        help="aidaptiv's host budget as a fraction of the model's ZeRO-3 state (default 0.25, as cpu_small)",
    )
    p.add_argument("--ds-configs", default=os.path.join(ROOT, "ds_configs"), help="folder of the shipped configs")
    p.add_argument("--swap-root", help="where the cells' swap folders go (default OUT/cells/<cell>/swap)")
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "bench", "results", "capacity_seq_len", "cap_5gib"),
        help="results folder (default bench/results/capacity_seq_len/cap_5gib)",
    )
    p.add_argument(
        "--no-prebuild",
        action="store_true",
        help="do not build DeepSpeed's JIT ops before the first cell (outside the cap)",
    )
    args = p.parse_args(argv)
    problems = []
    if args.steps < 2:
        problems.append(f"--steps {args.steps}: need at least 2 (one untimed, one timed)")
    for n in {args.max_seq[0], *args.max_seq[1].values()}:
        try:
            C.seq_grid(n)
        except ValueError as e:
            problems.append(str(e))
    if not 0 < args.aidaptiv_state_fraction < 1:
        problems.append(f"--aidaptiv-state-fraction {args.aidaptiv_state_fraction}: must be between 0 and 1")
    problems += [
        f"--{name.replace('_', '-')}: {v} is not a positive length or batch"
        for name in ("micro_batches", "confirm_seqs")
        for v in getattr(args, name)
        if v < 1
    ]
    from aidaptiv_ds.models.presets import PRESETS

    problems += [f"--models: {m} is not a preset ({', '.join(PRESETS)})" for m in args.models if m not in PRESETS]
    problems += [
        f"--max-seq: {m}={n} names no model of --models" for m, n in args.max_seq[1].items() if m not in args.models
    ]
    if problems:
        p.error("; ".join(problems))
    return args


def write_configs(args) -> dict:
    """({variant: its folder under OUT/configs holding <backend>.json}, {variant: extra train flags}). Every
    attempt runs with --no-fit-check: the sweep measures where a backend runs out, not where the plan says."""
    folders, flags = {}, {}
    for v in args.variants:
        backend = "aidaptiv" if v in AIDAPTIV else v
        with open(os.path.join(args.ds_configs, f"{backend}.json")) as f:
            cfg = json.load(f)
        if v in AIDAPTIV:
            cfg["aidaptiv"]["activations"] = {"policy": AIDAPTIV[v], "loss_chunk_tokens": LOSS_CHUNK_TOKENS}
            flags[v] = ["--no-fit-check"]
        else:
            flags[v] = ["--gradient-checkpointing", "--no-fit-check"]
        folder = os.path.join(args.out, "configs", v)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{backend}.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        folders[v] = folder
    return folders, flags


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Runner:
    """Runs one attempt as a capped cell of the sweep harness and returns its row."""

    GRID = "capacity_seq_len"
    write_configs = staticmethod(write_configs)

    def __init__(self, args, env):
        from aidaptiv_ds.common.sizes import state_bytes_per_param
        from aidaptiv_ds.harness.machine import machine_info

        self.args, self.env = args, env
        self.folders, self.flags = self.write_configs(args)
        self.cap = host_cap(args.host_mem_cap_gb, args.host_mem_cap_mechanism)
        if isinstance(self.cap, str):
            raise SystemExit(f"error: {self.cap}")
        self.deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        if not os.access(self.deepspeed, os.X_OK):
            self.deepspeed = shutil.which("deepspeed") or "deepspeed"
        sha, dirty = git_state(ROOT)
        self.ctx = {
            "out": args.out,
            "grid": self.GRID,
            "git_sha": sha,
            "git_dirty": dirty,
            "steps": args.steps,
            "warmup": 1,
            "lr": None,
            "timeout_s": args.timeout_s,
            "gpu_mem_cap_gb": None,
            "cap": self.cap,
            "machine": machine_info(args.swap_root or args.out),
            "spec": LaunchSpec(),
            "grid_obj": self,
        }
        self.budget_per_param = getattr(args, "aidaptiv_state_fraction", 0) * state_bytes_per_param()

    def aidaptiv_budget_bytes(self, model: str, gpus: int) -> int:
        """aidaptiv's host budget per rank (what a sweep grid's aidaptiv_state_fraction gives; build_row asks)."""
        from aidaptiv_ds.models.presets import nominal_parameters

        return int(self.budget_per_param * nominal_parameters(model) / gpus)

    def budget(self, variant: str, model: str):
        return self.aidaptiv_budget_bytes(model, 1) if variant in AIDAPTIV else None

    def __call__(self, variant: str, model: str, micro_batch: int, seq_len: int, phase: str, key: str) -> dict:
        backend = "aidaptiv" if variant in AIDAPTIV else variant
        cell = Cell(model, backend, 1, micro_batch, seq_len, 1)
        return self.run_attempt(
            cell,
            variant=variant,
            ds_configs=self.folders[variant],
            flags=self.flags[variant],
            budget=self.budget(variant, model),
            phase=phase,
            key=key,
        )

    def run_attempt(
        self,
        cell: Cell,
        *,
        variant: str,
        ds_configs: str,
        flags: list[str],
        budget,
        phase: str,
        key: str,
        config_for=None,
    ) -> dict:
        """Runs ``cell`` capped (the train command with ``flags`` after it; ``budget``: aidaptiv's host budget
        bytes or None) and returns its row. ``config_for(cell_dir)``: writes a config for this attempt and
        returns its path (zero_infinity_eqmem), else ds_configs/<backend>.json is used."""
        spec = LaunchSpec(accelerator="cpu", deepspeed=self.deepspeed, train=train_spec(None), ds_configs=ds_configs)
        cell_dir = os.path.join(self.args.out, "cells", f"{variant}__{cell.id}")
        swap = (
            os.path.join(self.args.swap_root, f"{variant}__{cell.id}.{os.getpid()}")
            if self.args.swap_root
            else os.path.join(cell_dir, "swap")
        )
        shutil.rmtree(cell_dir, ignore_errors=True)  # never read an old metrics.json
        os.makedirs(cell_dir)
        shutil.rmtree(swap, ignore_errors=True)
        os.makedirs(swap, mode=0o700)
        os.chmod(swap, 0o700)  # model state is private (DESIGN.md); makedirs' mode is masked by the umask
        metrics = os.path.join(cell_dir, "metrics.json")
        cmd = (
            launch_command(
                cell,
                spec,
                port=free_port(),
                swap_dir=swap,
                metrics_out=metrics,
                steps=self.args.steps,
                warmup=1,
                host_budget_bytes=budget,
                config=config_for(cell_dir) if config_for else None,
            )
            + flags
            + ["--no-progress"]
        )
        cap_gb = self.cap["gb"]
        cgroup, watchdog, cap_used = None, False, {}
        if cap_gb and self.cap["factory"] is not None:
            try:
                cgroup = self.cap["factory"].create(
                    f"aidaptiv-ds-cap-{os.getpid()}-{uuid.uuid4().hex[:8]}", int(cap_gb * 2**30)
                )
                cap_used = {"detail": cgroup.path}
            except OSError as e:
                cap_used, watchdog = {"mechanism": "rss-watchdog", "detail": f"cgroup creation failed: {e}"}, True
        elif cap_gb:
            watchdog = True
        t0 = _now()
        try:
            run = run_cell(
                cmd,
                cell_dir=cell_dir,
                metrics_path=metrics,
                timeout_s=self.args.timeout_s,
                env=self.env,
                cwd=ROOT,
                cap_bytes=int(cap_gb * 2**30) if cap_gb else None,
                cgroup=cgroup,
                watchdog=watchdog,
            )
        finally:
            shutil.rmtree(swap, ignore_errors=True)
        outcome = classify(
            returncode=run.returncode,
            timed_out=run.timed_out,
            timeout_s=self.args.timeout_s,
            cap_kill=run.cap_kill,
            output_tail=run.output_tail,
            metrics=run.metrics,
            metrics_problem=run.metrics_problem,
        )
        ctx = dict(self.ctx, spec=spec)
        row = build_row(
            cell,
            ctx=ctx,
            outcome=outcome,
            run=run,
            command=shlex.join(cmd),
            time_start=t0,
            time_end=_now(),
            cell_dir=cell_dir,
            cap_used=cap_used,
        )
        m = run.metrics or {}
        row.update(
            attempt_key=key,
            variant=variant,
            phase=phase,
            fits=row["status"] == "ok" and C.losses_finite(row["losses"]),
            gradient_checkpointing=m.get("gradient_checkpointing"),
            activations=m.get("activations"),
            loss_logits_mb=m.get("loss_logits_mb"),
        )
        return row


def max_seq_text(args):
    default, per_model = args.max_seq
    rest = [f"{m}: {n:,}" for m, n in per_model.items() if n != default]
    return f"{default:,}" + (f" ({'; '.join(rest)})" if rest else "")


def prepare(args) -> dict:
    """Makes OUT/cells (and --swap-root), removes shared memory leaked by earlier runs, and returns the cells'
    environment (this checkout first on the path, the build tools of this interpreter first)."""
    args.out = os.path.abspath(args.out)
    os.makedirs(os.path.join(args.out, "cells"), exist_ok=True)
    if args.swap_root:
        args.swap_root = os.path.abspath(args.swap_root)
        os.makedirs(args.swap_root, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    from aidaptiv_ds import remove_leaked_shared_memory
    from aidaptiv_ds.harness.prebuild import put_build_tools_first

    put_build_tools_first(env)
    removed = remove_leaked_shared_memory()
    if removed:
        print(removed, file=sys.stderr)
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    env = prepare(args)
    runner = Runner(args, env)
    if not args.no_prebuild:
        from aidaptiv_ds.harness.prebuild import prebuild

        backends = {"aidaptiv" if v in AIDAPTIV else v for v in args.variants}
        for line in prebuild(backends, env):
            print(f"DeepSpeed op {line}", file=sys.stderr)

    log = C.AttemptLog(os.path.join(args.out, ROWS_FILE), append_row)
    for p in log.problems:
        print(f"warning: {p}", file=sys.stderr)
    cap = args.host_mem_cap_gb
    found = []
    t_start = time.monotonic()

    def show(row, reused):
        a = C.attempt_from_row(row)
        what = (
            f"fits, {a.tokens_per_s:,.1f} tokens/s" if a.fits and a.tokens_per_s else "fits" if a.fits else a.failure()
        )
        when = "row kept from an earlier run" if reused else f"{row['wall_s']:.0f} s"
        print(
            f"  {row['variant']} {row['model']} mb{row['micro_batch']} seq {row['seq_len']:,} ({row['phase']}): "
            f"{what} [{when}]",
            file=sys.stderr,
            flush=True,
        )

    for model in args.models:
        grid = C.seq_grid(max_seq_of(args, model))
        for mb in args.micro_batches:
            for variant in args.variants:

                def key_of(seq, variant=variant, model=model, mb=mb):
                    return C.attempt_key(variant, model, mb, seq, cap, args.steps)

                def run(seq, phase, variant=variant, model=model, mb=mb):
                    return runner(variant, model, mb, seq, phase, key_of(seq))

                try_seq = C.resumable(log, key_of, run, show)
                print(f"{variant} {model} micro-batch {mb}: searching 256..{grid[-1]:,}", file=sys.stderr)
                result = C.search_longest(grid, try_seq)
                f = C.Found(variant, model, mb, result)
                for s in args.confirm_seqs:
                    if s not in grid and result.longest is not None and result.longest > s:
                        f.confirmed[s] = try_seq(s, "confirm")
                found.append(f)
    lines = [
        f"# Capacity under a {cap:g} GiB host cap" if cap else "# Capacity (no host cap)",
        "",
        f"Longest sequence that trains {args.steps} steps with finite losses, one CPU process, lengths in "
        f"multiples of 256 up to {max_seq_text(args)}; rows in {ROWS_FILE}. Machine: "
        f"{runner.ctx['machine'].get('cpu')}, {runner.ctx['machine'].get('cores')} cores; host cap via "
        f"{runner.cap['mechanism']}; git {runner.ctx['git_sha']}{' (dirty)' if runner.ctx['git_dirty'] else ''}.",
        "",
        *C.summary_table(found),
        "",
        "aidaptiv / zero_infinity (longest sequence):",
        "",
        *C.ratio_lines(found),
    ]
    return write_summary(args.out, lines, t_start)


def write_summary(out: str, lines: list[str], t_start: float) -> int:
    """OUT/summary.md from ``lines``, also printed; the sweep's time on stderr."""
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as fh:
        fh.write(text)
    print(text)
    print(f"done in {time.monotonic() - t_start:.0f} s; {os.path.join(out, 'summary.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
