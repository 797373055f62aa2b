"""The torch.distributed env:// variables of a rank started by SLURM's srun, from the variables srun sets.

Under ``srun python -m aidaptiv_ds train ...`` (by hand, or DeepSpeed's ``--launcher slurm``) no launcher sets
RANK/WORLD_SIZE/LOCAL_RANK; without them every process would make itself rank 0 of 1. Inside an srun step
(SLURM_STEP_ID and SLURM_PROCID set; a batch script's own shell has neither a step id nor the step's task
count, so a plain ``python -m aidaptiv_ds train`` there stays one process):

  RANK              <- SLURM_PROCID
  WORLD_SIZE        <- SLURM_STEP_NUM_TASKS, else SLURM_NTASKS
  LOCAL_RANK        <- SLURM_LOCALID
  LOCAL_WORLD_SIZE  <- this node's entry of SLURM_STEP_TASKS_PER_NODE (e.g. "4(x2),2"), by SLURM_NODEID
  MASTER_ADDR       <- the first host of SLURM_STEP_NODELIST, else of SLURM_JOB_NODELIST (rank 0 runs on the
                       step's first node), else SLURM_LAUNCH_NODE_IPADDR (the node srun ran on)
  MASTER_PORT       <- 20000 + SLURM_JOB_ID mod 10000, the same on every rank of the job (29500 without a job id)

Variables already set are left alone (a launcher's, or the user's). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
from typing import Dict, Mapping, Optional, Tuple

PORT_BASE, PORT_SPAN = 20000, 10000
DEFAULT_PORT = 29500  # torch.distributed's usual port; every rank must pick the same one, so not a free one


def in_srun_step(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_STEP_ID")) and bool(env.get("SLURM_PROCID"))


def first_host(nodelist: str) -> Optional[str]:
    """The first host of a SLURM host list: "gpu-a[01-04,07],gpu-b3" -> "gpu-a01", "n1,n2" -> "n1"."""
    text = nodelist.strip()
    if not text:
        return None
    m = re.match(r"([^,\[]*)(\[([^\]]*)\])?", text)
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix or None
    first = ranges.split(",")[0].split("-")[0]  # zero padding is part of the number's text, as SLURM writes it
    return prefix + first + text[m.end() :].split(",")[0] if first else None


def tasks_on_node(tasks_per_node: str, node_id: int) -> Optional[int]:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE ("4(x2),2": nodes 0 and 1 run 4, node 2 runs 2)."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id] if 0 <= node_id < len(counts) else None


def rendezvous(env: Mapping[str, str]) -> Dict[str, Tuple[str, str]]:
    """{variable: (value, where it came from)} for the env:// variables ``env`` lacks, from srun's variables;
    {} outside an srun step, or when RANK and WORLD_SIZE are already set."""
    if not in_srun_step(env) or ("RANK" in env and "WORLD_SIZE" in env):
        return {}
    found: Dict[str, Tuple[str, str]] = {}

    def take(var: str, *sources: str) -> None:
        for src in sources:
            if env.get(src, "").strip():
                found[var] = (env[src].strip(), src)
                return

    take("RANK", "SLURM_PROCID")
    take("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    take("LOCAL_RANK", "SLURM_LOCALID")
    node_id = env.get("SLURM_NODEID", "").strip()
    if env.get("SLURM_STEP_TASKS_PER_NODE") and node_id.isdigit():
        n = tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], int(node_id))
        if n is not None:
            found["LOCAL_WORLD_SIZE"] = (str(n), "SLURM_STEP_TASKS_PER_NODE")
    for src in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        host = first_host(env.get(src, ""))
        if host:
            found["MASTER_ADDR"] = (host, f"first host of {src}")
            break
    else:
        take("MASTER_ADDR", "SLURM_LAUNCH_NODE_IPADDR")
    job = env.get("SLURM_JOB_ID", "").strip()
    found["MASTER_PORT"] = (
        (str(PORT_BASE + int(job) % PORT_SPAN), "SLURM_JOB_ID")
        if job.isdigit()
        else (str(DEFAULT_PORT), "default: no SLURM_JOB_ID")
    )
    return {k: v for k, v in found.items() if k not in env}


def describe(found: Dict[str, Tuple[str, str]]) -> str:
    """One line naming each variable set and its source, for the job's log."""
    return ", ".join(f"{k}={v} (from {src})" for k, (v, src) in found.items())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_process_env() -> None:
    """Without a launcher, make this process rank 0 of 1 (DeepSpeed needs the env:// rendezvous variables);
    started by srun, take them from SLURM's variables (aidaptiv_ds.job.rank_env) and say which."""
    from aidaptiv_ds.job import rank_env as slurm_env

    found = slurm_env.rendezvous(os.environ)
    if found:
        os.environ.update({k: v for k, (v, _) in found.items()})
        if os.environ.get("RANK") == "0":
            print(f"aidaptiv-ds train: srun step: {slurm_env.describe(found)}", file=sys.stderr, flush=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def make_nvme_path(path: str) -> bool:
    """Make the swap folder ``path`` on this node, private (0700: it will hold model state), when missing; True
    when this process made it. A folder that already exists (another rank of this node made it first) is kept
    as it is. The folder is removed at exit if the job left it empty; the atexit hook, registered before the
    swapper starts, runs after the swapper's own clean-up (atexit runs last-registered first)."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        return False
    os.chmod(path, 0o700)  # makedirs' mode is masked by the umask
    import atexit

    def remove_if_empty():
        with contextlib.suppress(OSError):  # not empty: another rank's files, or kept swap files
            os.rmdir(path)

    atexit.register(remove_if_empty)
    return True


def end_rank_process(code: int):
    """End this rank of a multi-rank job with ``code`` once its run is over: the atexit hooks (the swapper's
    clean-up, make_nvme_path's folder removal, logging's flush) run first, then stdout and stderr are flushed,
    then the process ends without the interpreter's own teardown.

    Why: after the run, destroy_process_group() leaves the gloo groups' threads (gloo_tcp_loop and two
    pt_gloo_runloop per group) running, because DeepSpeed's engine, optimizer, every parameter's
    ds_process_group and deepspeed.utils.groups still hold the groups. They were then torn down during the
    interpreter's finalization, racing the peer that had already exited, and once in CI a rank that had finished
    its run cleanly died there with "terminate called without an active exception" (SIGABRT, exit -6), failing
    the job (torch's gloo has the same abort at exit: pytorch issues 190489 and 179291). Nothing of the run is
    left to do at this point; skipping the teardown removes the race."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
