#!/usr/bin/env python3
"""Capacity by model size (issue 27): the largest model each backend fine-tunes under a host memory cap.

For every backend x mode (full fine-tuning, LoRA), the model sizes of --models are tried in order of their
parameter count, each for --steps steps (every loss finite) at micro-batch 1 x --seq-len on one CPU process,
inside a memory cgroup of --host-mem-cap-gb (the sweep's mechanism; else the RSS watchdog). The climb stops at
the first size that does not train: that size's outcome is the limit the table names (the host cap's kill, an
error, a timeout). A size whose swap files could not fit the free space of the swap disk is not started: its
row says "disk" with the bytes it would need and the bytes free (the issue's "the disk bounds the largest size
here"); nothing above it is tried either.

Backends at their best documented settings for memory (as bench/capacity_seq_len.py):
- zero3, zero3_cpu_offload, zero_infinity: the shipped ds_configs/<name>.json, with `train
  --gradient-checkpointing`; zero_infinity's parameter buffers sized to the model's largest parameter where the
  shipped 20M elements are smaller (DeepSpeed's documented rule; it cannot run with less).
- zero_infinity_eqmem: zero_infinity.json sized to aidaptiv's host budget (aidaptiv_ds/harness/eqmem.py: no RAM
  cache when its fixed buffers alone exceed the budget), with --gradient-checkpointing.
- aidaptiv: ds_configs/aidaptiv.json, its activation policy "auto", a host budget of --host-budget (a quarter of
  the default 8 GiB cap) or, where the swapper needs more for a model, its minimum with 5% to spare
  (budget_for: Qwen2.5-3B's embedding alone is a 1.2 GB layer group; the swapper reads no group ahead where
  the budget cannot hold that).
LoRA adds `train --lora r=16,alpha=32,targets=q_proj,v_proj` to each (PEFT on the stock backends; aidaptiv
streams the frozen base read-only); ZeRO-Infinity's LoRA cells go without --gradient-checkpointing (ZI_LORA),
and zero_infinity_eqmem has no LoRA cells (EQMEM_LORA).

Swap bytes a size needs (checked against the free space before it starts): full fine-tuning on the NVMe
backends 16 B a parameter (the fp32 parameter, both Adam moments, and the gradient or the master copy), LoRA 4
B (the frozen fp32 base); zero3 and zero3_cpu_offload write nothing there.

Rows (the sweep's row fields, plus attempt_key, variant, mode, fits) go to OUT/rows.jsonl, resumable as
bench/capacity_seq_len.py's (a row with the same key is not run again); logs stay in OUT/cells/. OUT/summary.md gets
the table; bench/readme_tables.py puts it in docs/RESULTS.md.

    python bench/capacity_models.py                                  # the issue's table: about 1.5 h here
    python bench/capacity_models.py --models micro,tiny --variants zero3,aidaptiv --modes full \\
        --host-mem-cap-gb 3 --out /tmp/capacity_models_check         # a short check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import capacity_seq_len as seqcap  # noqa: E402  (bench/capacity_seq_len.py: the capped attempt runner)

from aidaptiv_ds.common.sizes import swap_bytes_per_param  # noqa: E402
from aidaptiv_ds.harness import capacity as C  # noqa: E402
from aidaptiv_ds.harness import eqmem  # noqa: E402
from aidaptiv_ds.harness.grid import Cell  # noqa: E402
from aidaptiv_ds.harness.hostcap import MECHANISMS  # noqa: E402
from aidaptiv_ds.harness.results import append_row  # noqa: E402

ROWS_FILE = "rows.jsonl"
VARIANTS = ("zero3", "zero3_cpu_offload", "zero_infinity", eqmem.BACKEND, "aidaptiv")
MODES = ("full", "lora")
LADDER = ("tiny", "small", "tinyllama-1.1b", "qwen2.5-3b", "llama2-7b", "llama2-13b")
LORA = "r=16,alpha=32,targets=q_proj,v_proj"
IN_MEMORY = ("zero3", "zero3_cpu_offload")
SWAP_BYTES_PER_PARAM = {"full": swap_bytes_per_param(4), "lora": 4}  # fp32: what aidaptiv's own check counts
EQMEM_LORA = (
    "its sizing is for full fine-tuning's optimizer state; with LoRA's handful of trainable parameters that "
    "sizing makes DeepSpeed 0.19.8 stop at the first step (AssertionError: param 6 already assigned swap buffer "
    "id 0); ZeRO-Infinity as shipped is the LoRA baseline"
)
ZI_LORA = (
    "ZeRO-Infinity's LoRA cells run without --gradient-checkpointing: with it, DeepSpeed 0.19.8 stops in the "
    "first backward on the shipped config (AssertionError: Not enough buffers 0 for swapping 1: the recomputed "
    "forward asks for parameter buffers the backward still holds); at 128 tokens the activations it would "
    "save are small"
)
DISK_MARGIN_BYTES = 2 * 2**30
"""Free space kept beyond a size's swap bytes: logs, checkpoints of nothing, the file system's own needs."""


def swap_bytes_needed(variant: str, mode: str, params: int) -> int:
    """What a size's swap folder holds at most (the module docstring's rule); 0 for the in-memory backends."""
    return 0 if variant in IN_MEMORY else SWAP_BYTES_PER_PARAM[mode] * params


def disk_refusal(variant: str, mode: str, params: int, free_bytes: int):
    """A row's error text when the size cannot fit the swap disk, else None."""
    need = swap_bytes_needed(variant, mode, params)
    if need and need + DISK_MARGIN_BYTES > free_bytes:
        return (
            f"the swap disk has {free_bytes / 1e9:.1f} GB free; {variant} {mode} needs about {need / 1e9:.1f} GB "
            f"({SWAP_BYTES_PER_PARAM[mode]} B x {params / 1e9:.2f} B parameters) plus {DISK_MARGIN_BYTES / 2**30:g} "
            "GiB of margin"
        )
    return None


BUDGET_STEP = 256 * 2**20


def budget_for(model: str, floor: int, seq_len: int) -> int:
    """aidaptiv's host budget for ``model``: ``floor``, or where the swapper's minimum for full fine-tuning is
    more, that minimum with 5% to spare, rounded up to 256 MiB. The minimum is the planner's figure (the run's
    own arithmetic) without read-ahead, which the swapper drops by itself when the budget cannot hold it: two
    slots of the largest layer group and the optimizer's room. Qwen2.5-3B's 152k-token embedding is a 1.2 GB
    group by itself (and the largest optimizer sub-group's gradient), so its minimum is about 3.9 GiB."""
    from aidaptiv_ds.planner.memory import Hardware, Job, plan_backend
    from aidaptiv_ds.planner.shapes import resolve_shape

    def split(budget, depth):
        job = Job(resolve_shape(model), seq_len, 1, dtype="fp32", host_budget=budget)
        job.prefetch_depth = depth
        return plan_backend("aidaptiv", job, Hardware(gpus=1, host_mem=1 << 40)).split

    budget = floor
    for _ in range(4):  # the optimizer's room grows with the budget (its chunk size is auto): settle
        if split(budget, 1).fits:
            return budget
        budget = max(budget, -(-int(split(budget, 0).minimum * 1.05) // BUDGET_STEP) * BUDGET_STEP)
    return budget


def moe_active_parameters(name: str) -> int | None:
    """The parameters one token uses, for a mixture-of-experts preset; None for a dense one."""
    from aidaptiv_ds.models.presets import MOE_FAMILIES, preset_config
    from aidaptiv_ds.models.presets import active_parameters as active

    config = preset_config(name)
    return active(config) if config.model_type in MOE_FAMILIES else None


def climb(models: list[str], attempt) -> tuple[str | None, dict | None, list[dict]]:
    """Tries ``models`` in order while they fit. ``attempt(model)`` returns a row with ``fits``. Returns (the
    largest that fit, the row of the first that did not (None: every size fit), every row)."""
    largest, stopped, rows = None, None, []
    for m in models:
        row = attempt(m)
        rows.append(row)
        if not row["fits"]:
            stopped = row
            break
        largest = m
    return largest, stopped, rows


def parse_args(argv=None):
    from aidaptiv_ds.common.sizes import parse_size
    from aidaptiv_ds.models.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variants",
        type=seqcap._list("variant(s)", allowed=VARIANTS),
        default=list(VARIANTS),
        help=f"comma list of {', '.join(VARIANTS)} (default all)",
    )
    p.add_argument("--modes", type=seqcap._list("mode(s)", allowed=MODES), default=list(MODES), help="full,lora")
    p.add_argument(
        "--models",
        type=seqcap._list("model presets"),
        default=list(LADDER),
        help=f"the sizes, tried smallest first (default {','.join(LADDER)})",
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--steps", type=int, default=2, help="steps per attempt, the first untimed (default 2)")
    p.add_argument("--timeout-s", type=float, default=3600, help="per attempt, start-up included (default 3600)")
    p.add_argument("--host-mem-cap-gb", type=float, default=8.0, help="per cell's process tree (default 8)")
    p.add_argument("--host-mem-cap-mechanism", choices=MECHANISMS, default="auto")
    p.add_argument(
        "--host-budget",
        default="2GiB",
        help="aidaptiv's host budget (more where a model needs it: budget_for), and what zero_infinity_eqmem is "
        "sized to (default 2GiB)",
    )
    p.add_argument("--ds-configs", default=os.path.join(ROOT, "ds_configs"), help="folder of the shipped configs")
    p.add_argument("--swap-root", help="where the cells' swap folders go (default OUT/cells/<cell>/swap)")
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "bench", "results", "capacity_models", "cap_8gib"),
        help="results folder (default bench/results/capacity_models/cap_8gib)",
    )
    p.add_argument("--no-prebuild", action="store_true", help="do not build DeepSpeed's JIT ops first")
    args = p.parse_args(argv)
    problems = [f"--models: {m} is not a preset ({', '.join(PRESETS)})" for m in args.models if m not in PRESETS]
    if args.steps < 2:
        problems.append(f"--steps {args.steps}: need at least 2 (one untimed, one timed)")
    if args.seq_len < 1:
        problems.append(f"--seq-len {args.seq_len}: must be positive")
    try:
        args.host_budget_bytes = parse_size(args.host_budget)
    except ValueError as e:
        problems.append(f"--host-budget {args.host_budget}: {e}")
    else:
        if args.host_mem_cap_gb and args.host_budget_bytes >= args.host_mem_cap_gb * 2**30:
            problems.append(f"--host-budget {args.host_budget} must be below the cap ({args.host_mem_cap_gb:g} GiB)")
    if problems:
        p.error("; ".join(problems))
    return args


class Runner(seqcap.Runner):
    """bench/capacity_seq_len.py's capped attempt, for the variants and modes of this sweep."""

    GRID = "capacity_models"

    @staticmethod
    def write_configs(args):
        folders, flags = {}, {}
        for v in args.variants:
            base = eqmem.BASE if v == eqmem.BACKEND else v
            with open(os.path.join(args.ds_configs, f"{base}.json")) as f:
                cfg = json.load(f)
            folder = os.path.join(args.out, "configs", v)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{base}.json"), "w") as f:
                json.dump(cfg, f, indent=1)
            folders[v] = folder
            flags[v] = ["--no-fit-check"] + ([] if v == "aidaptiv" else ["--gradient-checkpointing"])
        return folders, flags

    def same_settings(self, row: dict, mode: str, model: str) -> bool:
        """Whether a logged row was made with this run's host budget (aidaptiv's, and eqmem's sizing) and LoRA
        spec (rows without the field are from before it was recorded and are taken as they are)."""
        if row.get("variant") in ("aidaptiv", eqmem.BACKEND) and row.get("status") != "disk":
            budget = row.get("aidaptiv_host_budget_bytes")
            if budget is not None and budget != self.aidaptiv_budget_bytes(model, 1):
                return False
        return mode != "lora" or row.get("lora") in (None, LORA)

    def aidaptiv_budget_bytes(self, model: str, gpus: int) -> int:
        return budget_for(model, self.args.host_budget_bytes, self.args.seq_len)

    def attempt(self, variant: str, mode: str, model: str) -> dict:
        from aidaptiv_ds.models.presets import nominal_parameters

        backend = variant
        cell = Cell(model, backend, 1, 1, self.args.seq_len, 1)
        key = f"{mode}__" + C.attempt_key(variant, model, 1, self.args.seq_len, self.cap["gb"], self.args.steps)
        swap_root = self.args.swap_root or self.args.out
        free = shutil.disk_usage(swap_root).free
        refusal = disk_refusal(variant, mode, nominal_parameters(model), free)
        if refusal:
            return {
                "attempt_key": key,
                "variant": variant,
                "mode": mode,
                "model": model,
                "params": nominal_parameters(model),
                "status": "disk",
                "error": refusal,
                "fits": False,
                "grid": self.GRID,
                "machine": self.ctx["machine"],
                "time_start": seqcap._now(),
            }

        def eqmem_config(cell_dir):
            sizing = eqmem.size_eqmem(self._zi_base(), model, 1, self.aidaptiv_budget_bytes(model, 1))
            return self._write_config(cell_dir, eqmem.eqmem_config(self._zi_base(), sizing))

        def zero_infinity_config(cell_dir):
            return self._write_config(cell_dir, eqmem.documented_config(self._zi_base(), model))

        config_for = {eqmem.BACKEND: eqmem_config, "zero_infinity": zero_infinity_config}.get(variant)
        flags = list(self.flags[variant]) + (["--lora", LORA] if mode == "lora" else [])
        if mode == "lora" and variant == "zero_infinity":
            flags.remove("--gradient-checkpointing")  # see ZI_LORA
        row = self.run_attempt(
            cell,
            variant=f"{mode}-{variant}",
            ds_configs=self.folders[variant],
            flags=flags,
            budget=self.aidaptiv_budget_bytes(model, 1) if variant == "aidaptiv" else None,
            phase="climb",
            key=key,
            config_for=config_for,
        )
        row.update(variant=variant, mode=mode, lora=LORA if mode == "lora" else None)
        return row

    @staticmethod
    def _write_config(cell_dir: str, cfg: dict) -> str:
        path = os.path.join(cell_dir, "ds_config.json")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)
        return path

    def _zi_base(self) -> dict:
        from aidaptiv_ds.config import ds_config

        # Both ZeRO-Infinity variants write the shipped file under its own name; either folder has it (a run of
        # --variants zero_infinity alone has no eqmem folder).
        folder = self.folders.get(eqmem.BACKEND) or self.folders["zero_infinity"]
        return ds_config.load(os.path.join(folder, f"{eqmem.BASE}.json"))


def _gb(v) -> str:
    return "-" if v is None else f"{v / 1e9:.2f}"


def summary_lines(results: list[tuple[str, str, str | None, dict | None, list[dict]]], args, runner) -> list[str]:
    """The markdown table: per mode and backend, the largest size that trained and what stopped the next."""
    from aidaptiv_ds.models.presets import nominal_parameters

    m = runner.ctx["machine"]
    moe = {name: active for name in args.models if (active := moe_active_parameters(name))}
    kind = "mixture-of-experts model" if len(moe) == len(args.models) else "model"
    lines = [
        f"# Capacity by {kind} size under {'an' if str(args.host_mem_cap_gb)[0] == '8' else 'a'} "
        f"{args.host_mem_cap_gb:g} GiB host cap",
        "",
        f"The largest model each backend fine-tunes for {args.steps} steps with finite losses: one CPU process, "
        f"micro-batch 1 x {args.seq_len} tokens, fp32, sizes tried smallest first ({', '.join(args.models)}), "
        f"the climb stopping at the first that does not train. aidaptiv's host budget, and the memory "
        f"zero_infinity_eqmem is sized to: {args.host_budget}, or a model's minimum where that is more (the "
        f"column). LoRA: `{LORA}`. Machine: {m.get('cpu')}, "
        f"{m.get('cores')} cores, {m.get('ram_gb', '?')} GiB RAM; host cap via {runner.cap['mechanism']}; swap "
        f"disk {shutil.disk_usage(args.swap_root or args.out).total / 1e9:.0f} GB. Rows in {ROWS_FILE}.",
        "",
        "| mode | backend | largest model trained | parameters | host budget GiB | step s | peak memory MiB | NVMe "
        "read / write GB a step | next size: what stopped it |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for mode, variant, largest, stopped, rows in results:
        ok = [r for r in rows if r["fits"]]
        top = ok[-1] if ok else None
        if stopped is None:
            limit = "none: every size tried trained"
        else:
            err = (stopped.get("error") or "").replace("|", "/").replace("\n", " ")
            limit = f"{stopped['model']}: {stopped['status']}" + (f" ({err[:160]})" if err else "")
        io = "-"
        if top and top.get("nvme_read_bytes") is not None:
            steps_timed = max(1, args.steps - 1)
            io = (
                f"{_gb(top['nvme_read_bytes'] / steps_timed)} / {_gb((top.get('nvme_write_bytes') or 0) / steps_timed)}"
            )
        peak = top and (top.get("cell_mem_peak_mb") or top.get("tree_peak_rss_mb"))
        size = f"{largest} | {nominal_parameters(largest) / 1e9:.2f} B" if largest else "none | -"
        if largest in moe:
            size += f" ({moe[largest] / 1e9:.2f} B active)"
        step = "-" if not top or top.get("step_s") is None else format(top["step_s"], ".1f")
        budget = top and top.get("aidaptiv_host_budget_bytes")
        if top and variant == eqmem.BACKEND:
            budget = (top.get("eqmem") or {}).get("budget_bytes")
        budget = f"{budget / 2**30:.2f}" if budget else "-"
        lines.append(
            f"| {mode} | {variant} | {size} | {budget} | {step} | {'-' if not peak else format(peak, ',.0f')} | {io} | {limit} |"
        )
    lines += [
        "",
        "NVMe bytes are the swap space's reads and writes over the timed steps, per step."
        + (
            " With 2 steps that is the second, whose forward applies aidaptiv's first (deferred) update: its Adam "
            "moments are still zeros and are not read, so a steady step reads 8 B a parameter more."
            if args.steps == 2
            else ""
        ),
    ]
    shas = sorted({r.get("git_sha", "?")[:7] for *_, rows in results for r in rows if r.get("git_sha")})
    if shas:
        lines += ["", f"Rows made at commit(s) {', '.join(shas)} (a row is kept until its cell's settings change)."]
    from aidaptiv_ds.common.sizes import state_bytes_per_param

    ram = m.get("ram_gb")
    for mode, variant, largest, _, _ in results:
        if variant == "aidaptiv" and largest and mode == "full":
            state = state_bytes_per_param() * nominal_parameters(largest) / 2**30
            lines += [
                "",
                f"aidaptiv's largest model in full fine-tuning, {largest}, has {state:.1f} GiB of training state "
                f"as ZeRO-3 counts it (fp32 parameter, gradient, master copy and two Adam moments: "
                f"{state_bytes_per_param()} B a parameter; aidaptiv's swap space holds {swap_bytes_per_param()} B of it, "
                f"an fp32 parameter being its own master) against {ram} GiB of RAM, and trained inside the "
                f"{args.host_mem_cap_gb:g} GiB cap.",
            ]
        if variant == "aidaptiv" and largest and mode == "lora":
            base = 4 * nominal_parameters(largest) / 2**30
            lines += [
                "",
                f"aidaptiv's largest LoRA base, {largest}, is {base:.1f} GiB of fp32 weights against {ram} GiB of "
                "RAM; the base is only read, so its bytes read a step are set against twice the base (once for "
                "the forward, once for the backward).",
            ]
    if moe:
        lines += [
            "",
            "Mixtures of experts: every expert is trained (its weights, gradient and optimizer state are held and "
            "swapped like any parameter), so memory and swap bytes go with all the parameters and compute with the "
            "active ones (a token's share of the experts). LoRA's q_proj,v_proj targets are the attention's; the "
            "experts stay frozen there.",
        ]
    if "lora" in args.modes and "zero_infinity" in args.variants:
        lines += ["", ZI_LORA + "."]
    if "lora" in args.modes and eqmem.BACKEND in args.variants:
        lines += ["", f"LoRA with zero_infinity_eqmem is not run: {EQMEM_LORA}."]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    env = seqcap.prepare(args)
    from aidaptiv_ds.harness.prebuild import prebuild
    from aidaptiv_ds.models.presets import nominal_parameters

    runner = Runner(args, env)
    if not args.no_prebuild:
        for line in prebuild({eqmem.BASE if v == eqmem.BACKEND else v for v in args.variants}, env):
            print(f"DeepSpeed op {line}", file=sys.stderr)
    log = C.AttemptLog(os.path.join(args.out, ROWS_FILE), append_row)
    for p in log.problems:
        print(f"warning: {p}", file=sys.stderr)
    models = sorted(args.models, key=nominal_parameters)
    t_start = time.monotonic()
    results = []
    for mode in args.modes:
        for variant in args.variants:

            def attempt(model, mode=mode, variant=variant):
                key = f"{mode}__" + C.attempt_key(variant, model, 1, args.seq_len, runner.cap["gb"], args.steps)
                row = log.get(key)
                # A disk refusal is checked again (space may have been freed since); a row made with another
                # host budget or LoRA spec than this run's is not this cell's.
                reused = row is not None and row.get("status") != "disk" and runner.same_settings(row, mode, model)
                if not reused:
                    row = runner.attempt(variant, mode, model)
                    log.add(row)
                what = "trained" if row["fits"] else f"{row['status']} ({(row.get('error') or '')[:160]})"
                when = "row kept from an earlier run" if reused else f"{row.get('wall_s', 0):.0f} s"
                print(f"  {mode} {variant} {model}: {what} [{when}]", file=sys.stderr, flush=True)
                return row

            if mode == "lora" and variant == eqmem.BACKEND:
                print(f"lora {variant}: not run ({EQMEM_LORA})", file=sys.stderr)
                continue
            print(f"{mode} {variant}: climbing {', '.join(models)}", file=sys.stderr, flush=True)
            results.append((mode, variant, *climb(models, attempt)))
    return seqcap.write_summary(args.out, summary_lines(results, args, runner), t_start)


if __name__ == "__main__":
    sys.exit(main())
