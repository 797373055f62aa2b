"""Know before launch whether a job fits, how fast it will run, and the config to run it with.

  aidaptiv-ds plan --model llama2-7b --seq-len 2048 --micro-batch 8 --gpu-mem 40GB --host-mem 192GB
  aidaptiv-ds plan --model tiny --seq-len 64 --micro-batch 2 --nvme-path /mnt/nvme --write-config plan.json

For each backend (ZeRO-3, ZeRO-3 CPU offload, ZeRO-Infinity, aidaptiv) it prints the GPU, host (pinned
and pageable) and NVMe bytes the job needs, broken down, whether it fits and why not, and the predicted step
time and tokens/s with the resource that bounds it. Sizes and rates default to this machine's (measured by
short probes, cached in ~/.cache/aidaptiv-ds/rates.json); every one can be given to plan for other
hardware. A plan for other hardware (--gpu-mem, --gpus beyond this machine's, --host-mem, --nodes above 1, or a
rate of the hardware given) measures nothing and uses no rate of this machine's hardware: its notes name the
flags of the rates it lacks for a step time. Without a GPU and without --gpu-mem the job is planned for
training on the CPU. A size typed without a unit is bytes; one below 1 MiB is refused ('--gpu-mem 40': write 40GB).

Exit status: 0 when at least one planned backend fits, 3 when none does, 1 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import List

from aidaptiv_ds.commands import flags
from aidaptiv_ds.common.sizes import GiB, check_unit, parse_size, parse_size_arg
from aidaptiv_ds.planner.configs import GPU_OVERHEAD_ASSUMED, aidaptiv_config, make_plans, parse_backends
from aidaptiv_ds.planner.memory import (
    ACTIVATION_POLICIES,
    BACKENDS,
    BackendPlan,
    Hardware,
    Job,
)
from aidaptiv_ds.planner.rates import Rates, machine_rates
from aidaptiv_ds.planner.shapes import resolve_shape

EXIT_FITS, EXIT_ERROR, EXIT_NONE_FITS = 0, 1, 3

# Each rate (aidaptiv_ds.planner.rates) and the flag that gives it.
RATE_FLAGS = {
    "nvme_read": "--nvme-read-bw",
    "nvme_write": "--nvme-write-bw",
    "pcie": "--pcie-bw",
    "gpu_flops": "--gpu-flops",
    "cpu_flops": "--cpu-flops",
    "cpu_adam": "--cpu-adam",
    "zero3_cpu": "--zero3-cpu",
    "framework_host": "--framework-mem",
    "launcher_host": "--launcher-mem",
}
# The rates of the hardware (the others are the memory of the software): giving one describes another machine.
HARDWARE_RATES = ("nvme_read", "nvme_write", "pcie", "gpu_flops", "cpu_flops", "cpu_adam", "zero3_cpu")


def _size(what: str):
    def parse(text: str) -> int:
        try:
            return parse_size_arg(text, what)  # '--gpu-mem 40' is 40 bytes, refused: the unit was left out
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _positive(what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not a whole number") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{what} {value} must be at least 1")
        return value

    return parse


def _rate(what: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not a number: give e.g. 3.2e9") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{what} {value} must be positive")
        return value

    return parse


def _bandwidth(what: str):
    def parse(text: str) -> float:
        t = text.strip()
        for suffix in ("/s", "ps"):
            if t.lower().endswith(suffix):
                t = t[: -len(suffix)]
        try:
            check_unit(t, what, per="/s")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        try:
            return float(parse_size(t, what))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e} (per second, e.g. 3.2GB/s)") from None

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from aidaptiv_ds.models.presets import preset_names

    p.add_argument(
        "--model",
        required=True,
        metavar="PRESET|HF_DIR",
        help=f"a preset ({', '.join(preset_names())}) or a local Hugging Face directory (its config.json)",
    )
    p.add_argument("--seq-len", type=_positive("--seq-len"), required=True, help="tokens per sequence")
    p.add_argument(
        "--micro-batch", type=_positive("--micro-batch"), required=True, help="sequences per rank per micro-step"
    )
    p.add_argument(
        "--grad-accum", type=_positive("--grad-accum"), default=1, help="micro-steps per optimizer step; default 1"
    )
    p.add_argument(
        "--gpus",
        type=_positive("--gpus"),
        default=1,
        help="ranks per node (GPUs; processes when training on CPU); default 1",
    )
    p.add_argument("--nodes", type=_positive("--nodes"), default=1, help="nodes; default 1")
    flags.add(
        p,
        flags.DTYPE,
        auto=True,
        default="bf16",
        help="training precision; auto: the model's own (its config's dtype; bf16 for a preset); default bf16",
    )
    p.add_argument(
        "--gpu-mem",
        type=_size("--gpu-mem"),
        default=None,
        metavar="SIZE",
        help="memory per GPU (e.g. 40GB); default: this machine's GPU, or none (train on CPU)",
    )
    p.add_argument(
        "--host-mem",
        type=_size("--host-mem"),
        default=None,
        metavar="SIZE",
        help="host memory per node (e.g. 512GB); default: this machine's (or its cgroup's limit)",
    )
    flags.add(
        p,
        flags.NVME_PATH,
        aliases=("--nvme",),
        nargs="+",
        default=None,
        help="swap directory (or several on distinct disks: their free space and bandwidth add up); "
        "its free space is checked and its bandwidth probed",
    )
    p.add_argument(
        "--nvme-free",
        type=_size("--nvme-free"),
        default=None,
        metavar="SIZE",
        help="free swap space per node, instead of the directory's",
    )
    p.add_argument("--backend", default="all", help=f"all, or one or more of {', '.join(BACKENDS)} (comma-separated)")
    p.add_argument(
        "--activations",
        choices=ACTIVATION_POLICIES,
        default=None,
        help="force one mode for every backend. keep: autograd keeps every activation; recompute: only layer "
        "inputs, recomputed in backward (gradient checkpointing, aidaptiv policy recompute); nvme: the layer "
        "inputs stored on NVMe and read back ahead of the backward (aidaptiv policy nvme, and the least its "
        "policy auto keeps; stock DeepSpeed has no such mode). Default: each backend with the first of its "
        "own modes that fits (stock: keep, recompute; aidaptiv: keep, recompute, nvme), said in its notes",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=_positive("--loss-chunk-tokens"),
        default=None,
        metavar="N",
        help="the LM head and loss in chunks of N tokens (aidaptiv.activations.loss_chunk_tokens): "
        "one chunk's logits exist at a time; default: unchunked",
    )
    g = p.add_argument_group("aidaptiv settings (default: chosen to fit)")
    flags.add(
        g,
        flags.HOST_BUDGET,
        default=None,
        help="aidaptiv.host_memory_budget: a size per rank, a share of the node's --host-mem ('25%%') or a "
        "size per node ('64GiB/node'), split between its --gpus ranks; default: the host memory left, at most "
        "what helps",
    )
    g.add_argument(
        "--layer-group-size",
        type=_positive("--layer-group-size"),
        default=4,
        help="upper bound on layers per group; default 4",
    )
    g.add_argument(
        "--prefetch-depth",
        type=int,
        default=1,
        choices=range(0, 17),
        metavar="0..16",
        help="layer groups read ahead; default 1",
    )
    r = p.add_argument_group(
        "rates (default: measured here by a short probe, cached; for other hardware, none: give them)"
    )
    r.add_argument(
        "--nvme-read-bw",
        type=_bandwidth("--nvme-read-bw"),
        default=None,
        metavar="BYTES/s",
        help="NVMe read bandwidth per node, e.g. 6.5GB/s",
    )
    r.add_argument("--nvme-write-bw", type=_bandwidth("--nvme-write-bw"), default=None, metavar="BYTES/s")
    r.add_argument(
        "--pcie-bw",
        type=_bandwidth("--pcie-bw"),
        default=None,
        metavar="BYTES/s",
        help="host-to-GPU bandwidth per GPU, e.g. 12GB/s (PCIe Gen3 x16)",
    )
    r.add_argument(
        "--gpu-flops",
        type=_rate("--gpu-flops"),
        default=None,
        metavar="FLOP/s",
        help="achieved GPU FLOP/s in the training dtype, e.g. 1.5e14",
    )
    r.add_argument(
        "--cpu-flops",
        type=_rate("--cpu-flops"),
        default=None,
        metavar="FLOP/s",
        help="achieved CPU FLOP/s of a node (all cores)",
    )
    r.add_argument(
        "--cpu-adam",
        type=_rate("--cpu-adam"),
        default=None,
        metavar="PARAMS/s",
        help="CPU Adam parameters/s of a node (all cores)",
    )
    r.add_argument(
        "--zero3-cpu",
        type=_rate("--zero3-cpu"),
        default=None,
        metavar="PARAMS/s",
        help="parameters/s of ZeRO-3's own per-step work when training on CPU (gathering, releasing, "
        "partitioning; measured here as a ZeRO-3 step of the tiny preset less its compute and Adam)",
    )
    r.add_argument(
        "--framework-mem",
        type=_size("--framework-mem"),
        default=None,
        metavar="SIZE",
        help="host memory per rank of torch, DeepSpeed and transformers themselves",
    )
    r.add_argument(
        "--launcher-mem",
        type=_size("--launcher-mem"),
        default=None,
        metavar="SIZE",
        help="host memory per node of the deepspeed launcher's own processes, counted for jobs of "
        "more than one rank (which need the launcher)",
    )
    r.add_argument(
        "--gpu-overhead",
        type=_size("--gpu-overhead"),
        default=None,
        metavar="SIZE",
        help=f"GPU memory per rank outside tensors (CUDA context, workspaces); default: "
        f"{GPU_OVERHEAD_ASSUMED / GiB:.0f} GiB, assumed",
    )
    r.add_argument("--no-probe", action="store_true", help="measure nothing: use given and cached rates only")
    r.add_argument("--reprobe", action="store_true", help="measure again even if cached")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--write-config",
        default=None,
        metavar="OUT.json",
        help="write a DeepSpeed config with the aidaptiv block this plan chose",
    )


def _nvme_free(dirs: List[str]) -> int:
    seen, free = set(), 0
    for d in dirs:
        dev = os.stat(d).st_dev
        if dev not in seen:
            seen.add(dev)
            free += shutil.disk_usage(d).free
    return free


def _log(msg: str) -> None:
    print(f"aidaptiv-ds plan: {msg}", file=sys.stderr, flush=True)


def run(args) -> int:
    try:
        return _run(args)
    except ValueError as e:
        print(f"aidaptiv-ds plan: {flags.as_flags(str(e))}", file=sys.stderr)
        return EXIT_ERROR


def _run(args) -> int:
    shape = resolve_shape(args.model)
    if args.dtype == "auto":  # the model's own precision; a preset has none, and plans in bf16 as by default
        from aidaptiv_ds.models.locate import config_dict
        from aidaptiv_ds.models.preset_shapes import PRESETS

        config = {} if args.model in PRESETS else config_dict(args.model)
        shipped = config.get("dtype") or config.get("torch_dtype")  # transformers 5 writes "dtype"
        args.dtype = {"float32": "fp32", "float16": "fp16"}.get(shipped, "bf16")
    backends = parse_backends(args.backend)
    nvme_dirs = [os.path.abspath(d) for d in args.nvme_path or []]
    from aidaptiv_ds.engine.disk import swap_folder_problem

    problems = [p for p in map(swap_folder_problem, nvme_dirs) if p]  # the rule of every swap folder
    if problems:
        raise ValueError("; ".join(f"--nvme-path {p}" for p in problems))
    from aidaptiv_ds.config.host import budget_bytes
    from aidaptiv_ds.engine.machine import cuda_memory_bytes, total_ram_bytes

    gpu_mem = args.gpu_mem if args.gpu_mem is not None else cuda_memory_bytes()
    host_mem = args.host_mem if args.host_mem is not None else total_ram_bytes()
    given = {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in RATE_FLAGS.items()}
    other = _other_hardware(args, gpu_mem, given)
    if other:
        _log(
            f"planning for other hardware ({', '.join(other)}): nothing is measured here and no rate of this "
            "machine's hardware is used; the plan's notes say which rates to give"
        )
    rates = Rates()
    for name, value in given.items():
        rates.set(name, value, "given")
    probe_dirs = nvme_dirs or [None]
    reads, writes = [], []
    for d in probe_dirs:  # one probe per distinct disk; the CPU, framework and GPU ones once
        r = machine_rates(
            args.dtype,
            d,
            probe=not args.no_probe,
            reprobe=args.reprobe,
            want_gpu=gpu_mem is not None and args.gpu_mem is None,
            given=given,
            log=_log,
            this_machine=not other,
        )
        reads.append(r.nvme_read)
        writes.append(r.nvme_write)
        rates = r
    if len(nvme_dirs) > 1 and all(reads) and all(writes) and args.nvme_read_bw is None:
        rates.set("nvme_read", sum(reads), rates.source.get("nvme_read", "") + f", {len(reads)} disks")
        rates.set("nvme_write", sum(writes), rates.source.get("nvme_write", "") + f", {len(writes)} disks")
    gpu_overhead = args.gpu_overhead if args.gpu_overhead is not None else GPU_OVERHEAD_ASSUMED
    hw = Hardware(
        gpus=args.gpus,
        nodes=args.nodes,
        gpu_mem=gpu_mem,
        host_mem=host_mem,
        nvme_free=args.nvme_free if args.nvme_free is not None else (_nvme_free(nvme_dirs) if nvme_dirs else None),
        framework_host=int(rates.framework_host or 0),
        # one rank per job runs without the launcher ('aidaptiv-ds train' directly); more need it
        launcher_host=int(rates.launcher_host or 0) if args.gpus * args.nodes > 1 else 0,
        gpu_overhead=gpu_overhead if gpu_mem is not None else 0,
    )
    job = Job(
        shape,
        args.seq_len,
        args.micro_batch,
        args.grad_accum,
        args.dtype,
        args.activations,
        loss_chunk_tokens=args.loss_chunk_tokens,
        host_budget=(budget_bytes(args.host_budget, host_mem, args.gpus) if args.host_budget is not None else None),
        layer_group_size=args.layer_group_size,
        prefetch_depth=args.prefetch_depth,
    )
    plans, predictions = make_plans(job, hw, rates, backends)
    if rates.framework_host is None:
        for p in plans:
            p.notes.append("framework host memory unknown (not probed, not given): counted as 0 (--framework-mem)")
    if rates.launcher_host is None and hw.world > 1:
        for p in plans:
            p.notes.append("launcher host memory unknown (not probed, not given): counted as 0 (--launcher-mem)")
    if other:
        for p in plans:
            p.notes.append(_other_hardware_note(other, p, predictions.get(p.backend), hw, rates))
    if gpu_mem is not None and args.gpu_overhead is None:
        for p in plans:
            p.notes.append(
                f"GPU overhead {GPU_OVERHEAD_ASSUMED / GiB:.0f} GiB per rank is assumed, not measured (--gpu-overhead)"
            )
    from aidaptiv_ds.planner import render

    # the planner names its parameters in backquotes (`nvme_path`); this command says them as its flags
    if args.json:
        print(flags.as_flags(json.dumps(render.as_dict(job, hw, rates, plans, predictions), indent=1)))
    else:
        print(flags.as_flags(render.table(job, hw, rates, plans, predictions)))
    if args.write_config and not _write_config(args, job, plans, nvme_dirs):
        return EXIT_NONE_FITS  # the job does not fit aidaptiv: exit 3 as for a plan where nothing fits
    return EXIT_FITS if any(p.fits for p in plans) else EXIT_NONE_FITS


def _other_hardware(args, gpu_mem, given: dict) -> List[str]:
    """What makes this a plan for other hardware, as the flags that said so; empty for this machine.

    For other hardware no rate of this machine is measured or used: a 2-core VM's CPU Adam rate made a plan of
    8 x 80 GB GPUs "645 s, bound cpu_adam". Its rates are asked for, not assumed: the CPU Adam rate of CPU
    classes spans more than ten times (a 2-core VM to two 64-core sockets) and a default would print a step time
    as firm as a measured one; the plan's notes name the flags of the rates it lacks."""
    from aidaptiv_ds.engine.machine import cuda_device_count

    why, here = [], cuda_device_count()
    if args.gpu_mem is not None:
        why.append("--gpu-mem")
    elif gpu_mem is not None and args.gpus > here:
        why.append(f"--gpus {args.gpus}, more than this machine's {here}")
    if args.host_mem is not None:
        why.append("--host-mem")
    if args.nodes > 1:
        why.append(f"--nodes {args.nodes}")
    return why + [RATE_FLAGS[n] for n in HARDWARE_RATES if given[n] is not None]


def _other_hardware_note(other: List[str], plan: BackendPlan, pred, hw: Hardware, rates: Rates) -> str:
    """The note of a plan for other hardware: that it is, and the rates it lacks for a step time."""
    note = f"planned for other hardware ({', '.join(other)}): no rate of this machine's hardware is measured or used"
    if not plan.fits or pred is None:
        return note
    lacking = [RATE_FLAGS[n] for m in pred.missing for n in m.split("/")]
    if lacking:
        return note + f"; give the other machine's {', '.join(lacking)} for a step time"
    if hw.gpu_mem is None and rates.zero3_cpu is None:
        return note + "; ZeRO-3's own work per step is left out of the step time (--zero3-cpu)"
    return note


def _write_config(args, job: Job, plans: List[BackendPlan], nvme_dirs: List[str]) -> bool:
    """Write the aidaptiv config the plan chose; False (nothing written, said why) when aidaptiv does not fit."""
    plan = next((p for p in plans if p.backend == "aidaptiv"), None)
    if plan is None:
        raise ValueError("--write-config writes the aidaptiv block: include aidaptiv in --backend")
    if not plan.fits:
        _log(f"--write-config: aidaptiv does not fit ({plan.problems[0]}): nothing written")
        return False
    cfg = aidaptiv_config(plan.job or job, plan, nvme_dirs[0] if nvme_dirs else ".")
    from aidaptiv_ds.config import resolve as aconfig
    from aidaptiv_ds.config.ds_config import ConfigError

    try:
        aconfig.validate(cfg, check_paths=bool(nvme_dirs))
    except ConfigError as e:
        # Planned for other hardware (a larger budget than this machine has, say): written all the same.
        _log(f"warning: {args.write_config} does not validate on this machine: {e}")
    with open(args.write_config, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    _log(f"wrote {args.write_config}")
    return True
