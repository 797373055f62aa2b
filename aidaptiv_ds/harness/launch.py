"""The command that launches one cell of a sweep: the deepspeed launcher's flags and train's flags for it.

    deepspeed --num_accelerators G --master_port P --no_local_rank --module aidaptiv_ds train
        --config ds_configs/<backend>.json --model <preset> --seq-len L --micro-batch B --grad-accum A
        --steps N --warmup W --nvme-path <swap dir> --metrics-out <cell dir>/metrics.json [--gpu-mem-cap-gb C]

``--no_local_rank``: without it the launcher puts ``--local_rank=K`` before the module's own arguments
(``python -m aidaptiv_ds --local_rank=0 train ...``), which a subcommand CLI rejects; ranks read
LOCAL_RANK from the environment instead. On CUDA with CUDA_VISIBLE_DEVICES set (SLURM does), the GPUs are
named with ``--include localhost:<ids>``, because ``--num_gpus`` would make the launcher drop that variable
and use GPUs 0..G-1. Across nodes, a hostfile (``host slots=K`` lines) and ``--num_nodes``/``--num_gpus``
per node are used, with ``--create-nvme-path`` after ``--nvme-path``: the sweep makes the cell's swap folder on
its own node only, so each rank makes it (0700) on a node that lacks it.

DeepSpeed 0.19.8's slurm launcher (``--launcher slurm``, which starts the ranks with srun) needs two things
it does not say, both found on a real SLURM controller (tests/cluster/): it drops ``--module`` (its srun command
is ``python -u <user_script> ...``), so the module is passed as the script ``-m`` after ``--``
(``deepspeed ... -- -m aidaptiv_ds train ...``: srun then runs ``python -u -m aidaptiv_ds train``); and it asks
srun for ``--gpus-per-node <num_gpus>``, which a cluster without GPUs refuses ("Invalid generic resource"), so
on CPU the nodes and the ranks on each are named with ``--include host:0,..,K-1@...`` from the hostfile instead.

The train module is ``aidaptiv_ds train`` unless AIDAPTIV_DS_TRAIN_MODULE or --train-module names another
(``"MODULE [ARGS...]"``), which is how the tests substitute a fake.
"""

from __future__ import annotations

import math
import os
import shlex
import socket
from dataclasses import dataclass
from typing import Optional

from aidaptiv_ds.harness.grid import Cell

DEFAULT_TRAIN = "aidaptiv_ds train"
TRAIN_ENV = "AIDAPTIV_DS_TRAIN_MODULE"


@dataclass(frozen=True)
class LaunchSpec:
    """How cells are launched on this machine or allocation."""

    accelerator: str = "cpu"
    """cpu or cuda."""
    deepspeed: str = "deepspeed"
    """The launcher executable."""
    train: str = DEFAULT_TRAIN
    """Module and leading arguments, e.g. "aidaptiv_ds train"."""
    ds_configs: str = "ds_configs"
    """Folder of <backend>.json files."""
    hostfile: Optional[str] = None
    """DeepSpeed hostfile for multi-node cells."""
    gpus_per_node: Optional[int] = None
    """Slots per node when a hostfile is used; a cell of G GPUs takes ceil(G / this) nodes."""
    master_addr: Optional[str] = None
    ds_launcher: Optional[str] = None
    """DeepSpeed's multi-node backend (pdsh, openmpi, slurm, ...); None keeps DeepSpeed's default."""
    visible_devices: Optional[str] = None
    """CUDA_VISIBLE_DEVICES as found at start (cuda only)."""

    def nodes_for(self, cell: Cell) -> int:
        if not self.hostfile or not self.gpus_per_node:
            return 1
        return max(1, math.ceil(cell.gpus / self.gpus_per_node))


def train_spec(flag: Optional[str] = None) -> str:
    """The train module: the flag, else $AIDAPTIV_DS_TRAIN_MODULE, else ``aidaptiv_ds train``."""
    return flag or os.environ.get(TRAIN_ENV) or DEFAULT_TRAIN


def config_path(spec: LaunchSpec, backend: str) -> str:
    return os.path.join(spec.ds_configs, f"{backend}.json")


def free_port() -> int:
    """A TCP port nobody listens on now (another process may still take it before the launcher does; the
    cell then fails with a clear error rather than hanging)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def hostfile_hosts(path: str) -> list[str]:
    """The hosts of a DeepSpeed hostfile (``host slots=K`` lines; blank lines and ``#`` comments skipped)."""
    with open(path, encoding="utf-8") as f:
        return [line.split()[0] for line in f if line.strip() and not line.lstrip().startswith("#")]


def _srun_on_cpu(spec: LaunchSpec) -> bool:
    """DeepSpeed's slurm launcher on CPU nodes: no --num_gpus (see the module docstring)."""
    return spec.ds_launcher == "slurm" and spec.accelerator == "cpu"


def launcher_args(cell: Cell, spec: LaunchSpec, port: int) -> list[str]:
    """The deepspeed launcher's own flags for this cell."""
    args = [spec.deepspeed]
    nodes = spec.nodes_for(cell)
    if spec.hostfile:
        if nodes > 1 and cell.gpus % nodes:
            raise ValueError(
                f"cell {cell.id}: {cell.gpus} GPUs do not split evenly over {nodes} nodes of "
                f"{spec.gpus_per_node}: choose GPU counts that are multiples of --gpus-per-node"
            )
        args += ["--hostfile", spec.hostfile]
        if _srun_on_cpu(spec):
            hosts = hostfile_hosts(spec.hostfile)
            if len(hosts) < nodes:
                raise ValueError(f"cell {cell.id} needs {nodes} nodes but {spec.hostfile} lists {len(hosts)}")
            slots = ",".join(str(i) for i in range(cell.gpus // nodes))
            args += ["--include", "@".join(f"{h}:{slots}" for h in hosts[:nodes])]
        else:
            args += ["--num_nodes", str(nodes), "--num_gpus", str(cell.gpus // nodes)]
        if spec.master_addr:
            args += ["--master_addr", spec.master_addr]
        if spec.ds_launcher:
            args += ["--launcher", spec.ds_launcher]
    elif spec.accelerator == "cuda" and spec.visible_devices:
        ids = [d.strip() for d in spec.visible_devices.split(",") if d.strip()]
        if cell.gpus > len(ids):
            raise ValueError(f"cell {cell.id} needs {cell.gpus} GPUs but CUDA_VISIBLE_DEVICES has {len(ids)}")
        args += ["--include", "localhost:" + ",".join(ids[: cell.gpus])]
    else:
        args += ["--num_accelerators", str(cell.gpus)]
    args += ["--master_port", str(port), "--no_local_rank"]
    return args


def launch_command(
    cell: Cell,
    spec: LaunchSpec,
    *,
    port: int,
    swap_dir: str,
    metrics_out: str,
    steps: int,
    warmup: int,
    gpu_mem_cap_gb: Optional[float] = None,
    host_budget_bytes: Optional[int] = None,
    config: Optional[str] = None,
) -> list[str]:
    """The whole command line of one cell (see the module docstring). ``config``: a config file written for
    this cell (zero_infinity_eqmem) instead of ds_configs/<backend>.json."""
    module, *lead = shlex.split(spec.train)
    if spec.hostfile and spec.ds_launcher == "slurm":  # DeepSpeed's slurm launcher drops --module
        cmd = launcher_args(cell, spec, port) + ["--", "-m", module, *lead]
    else:
        cmd = launcher_args(cell, spec, port) + ["--module", module, *lead]
    cmd += [
        "--config",
        config or config_path(spec, cell.backend),
        "--model",
        cell.model,
        "--seq-len",
        str(cell.seq_len),
        "--micro-batch",
        str(cell.micro_batch),
        "--grad-accum",
        str(cell.grad_accum),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--nvme-path",
        swap_dir,
    ]
    if spec.hostfile:  # ranks may run on other nodes, where the sweep did not make swap_dir
        cmd.append("--create-nvme-path")
    cmd += ["--metrics-out", metrics_out]
    if gpu_mem_cap_gb is not None:
        cmd += ["--gpu-mem-cap-gb", f"{gpu_mem_cap_gb:g}"]
    if host_budget_bytes is not None:
        cmd += ["--host-budget", str(host_budget_bytes)]
    return cmd
