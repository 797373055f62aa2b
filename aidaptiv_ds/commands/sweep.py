"""Run a grid of training cells (model x micro-batch x sequence x GPU count x backend) against the baselines.

  aidaptiv-ds sweep --grid bench/grids/cpu_ci.json --out bench/results/cpu_ci/this_machine
  aidaptiv-ds sweep --grid bench/grids/cdac_rudra.json --count-cells      # a SLURM array's size

Each cell is its own process tree through the deepspeed launcher; one JSON row per cell in OUT/results.jsonl.
See aidaptiv_ds.harness.sweep for the statuses, the host memory cap, the order of the cells and SLURM arrays.
"""

from __future__ import annotations

import argparse
import sys

from aidaptiv_ds.commands import flags
from aidaptiv_ds.harness import eqmem
from aidaptiv_ds.harness.grid import SWEEP_BACKENDS, GridError, enumerate_cells, interleave_repeats, load_grid
from aidaptiv_ds.harness.hostcap import MECHANISMS
from aidaptiv_ds.harness.sweep import SweepOptions, run_sweep


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _backend_list(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in SWEEP_BACKENDS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {bad or text!r}: choose from {','.join(SWEEP_BACKENDS)}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", required=True, help="grid file, e.g. bench/grids/cdac_rudra.json")
    p.add_argument("--out", help="results folder (results.jsonl, cells/); required unless listing cells")
    p.add_argument(
        "--backends",
        type=_backend_list,
        help=f"comma list replacing the grid's ({','.join(SWEEP_BACKENDS)}; {eqmem.BACKEND} is "
        "zero_infinity.json with its host memory sized to aidaptiv's budget)",
    )
    p.add_argument("--gpus", type=_int_list, help="comma list of GPU (on CPU: process) counts replacing the grid's")
    p.add_argument("--steps", type=int, help="steps per cell, warm-up included (default: the grid's)")
    p.add_argument("--warmup", type=int, help="untimed steps per cell (default: the grid's)")
    p.add_argument(
        "--timeout-s",
        type=float,
        help="per-cell wall-clock limit; the process tree is killed after it (default: the grid's timeout_s)",
    )
    flags.add(
        p,
        flags.GPU_MEM_CAP_GB,
        default=None,
        help="GPU memory per process, passed to train, so a large GPU behaves like e.g. a 40 GB A100 "
        "(default: the grid's)",
    )
    p.add_argument(
        "--host-mem-cap-gb",
        type=float,
        help="host memory (GiB) for each cell's whole process tree, enforced with a cgroup "
        "(v2 memory.max + memory.swap.max 0, or v1 memory.limit_in_bytes + memsw) when "
        "/sys/fs/cgroup allows, else an RSS watchdog (0.1 s) that kills the tree; a cell "
        "killed by it is status oom (default: the grid's)",
    )
    p.add_argument(
        "--host-mem-cap-mechanism",
        choices=MECHANISMS,
        default="auto",
        help="force one cap mechanism (default auto: cgroup2, cgroup1, then rss-watchdog)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="runs per cell, interleaved: every cell once, then every cell again "
        "(default: the grid's repeats, 1 when it has none)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip runs (cell and repeat) that already have a row in OUT/results.jsonl (any status)",
    )
    p.add_argument(
        "--skip-dominated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="do not run a cell when a smaller one (same model, backend, GPUs) ran out of memory; "
        "record it as oom with inferred: true (default: on)",
    )
    p.add_argument(
        "--skip-predicted-oom",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="do not run a cell that the planner (aidaptiv-ds plan) says will run out of memory under "
        "the caps; record it as oom with inferred: true (default: off: such cells run, and are "
        "reported as 'predicted OOM' beside their outcome)",
    )
    p.add_argument(
        "--max-cells", type=int, help="run only the first N cells of the ordered list (each of them --repeats times)"
    )
    p.add_argument("--list-cells", action="store_true", help="print 'index run-id' per run (cell and repeat) and exit")
    p.add_argument(
        "--count-cells",
        action="store_true",
        help="print the number of runs (cells x repeats) and exit (for sbatch --array=0-$((N-1)))",
    )
    p.add_argument(
        "--cell-index", type=int, help="run only the run at this index of the ordered list of runs (a SLURM array task)"
    )
    p.add_argument(
        "--train-module",
        help="module and leading args of the trainer (default: $AIDAPTIV_DS_TRAIN_MODULE or 'aidaptiv_ds train')",
    )
    p.add_argument(
        "--ds-configs",
        default=None,
        help="folder of <backend>.json (default: ./ds_configs, else the ds_configs/ of the checkout this "
        "aidaptiv-ds is installed from)",
    )
    p.add_argument("--deepspeed", help="the deepspeed launcher (default: the one next to this Python, else PATH)")
    p.add_argument(
        "--accelerator", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when nvidia-smi lists a GPU"
    )
    p.add_argument(
        "--swap-root",
        help="folder for the cells' swap folders (default OUT/cells/<id>/swap); put it on "
        "the NVMe under test, e.g. node-local disk when OUT is on a shared FS",
    )
    p.add_argument("--hostfile", help="DeepSpeed hostfile ('host slots=K' lines) for multi-node cells")
    p.add_argument("--gpus-per-node", type=int, help="with --hostfile: a cell of G GPUs uses G / K nodes")
    p.add_argument("--master-addr", help="with --hostfile: address of the first node")
    p.add_argument("--ds-launcher", help="with --hostfile: DeepSpeed's multi-node launcher (pdsh, openmpi, slurm, ...)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the launch command of each cell that would run (after --resume) and exit without running anything",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--prebuild",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="build DeepSpeed's just-in-time ops the backends need before the first cell, without "
        "the host cap (default on; a build inside a capped cell is killed like the cell)",
    )


def run(args: argparse.Namespace) -> int:
    """Choose the runs the flags ask for (or count or list them), then run them (harness.sweep.run_sweep)."""
    try:
        grid = load_grid(args.grid)
    except GridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cells = enumerate_cells(grid, backends=args.backends, gpus=args.gpus)
    if args.max_cells is not None:
        cells = cells[: max(0, args.max_cells)]
    repeats = args.repeats if args.repeats is not None else grid.repeats
    if repeats < 1:
        print(f"error: --repeats {repeats}: need at least 1", file=sys.stderr)
        return 2
    runs = interleave_repeats(cells, repeats)
    if args.count_cells:
        print(len(runs))
        return 0
    if args.list_cells:
        for i, r in enumerate(runs):
            print(i, r.id)
        return 0
    if not args.out:
        print("error: --out is required to run cells: give the results folder", file=sys.stderr)
        return 2
    if args.cell_index is not None:
        if not 0 <= args.cell_index < len(runs):
            print(
                f"error: --cell-index {args.cell_index} is outside 0..{len(runs) - 1} "
                f"(the grid has {len(cells)} cells x {repeats} repeats)",
                file=sys.stderr,
            )
            return 2
        runs = [runs[args.cell_index]]
    return run_sweep(grid, cells, runs, SweepOptions.from_namespace(args))
