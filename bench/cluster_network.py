"""The cost of the network path between nodes, and the plan of a multi-node cell against what it used, on the real
SLURM cluster of scripts/cluster.sh (network namespaces on one machine: every "node" shares its cores and disk).

    python bench/cluster_network.py                 # tiny preset, 3 repeats of each side, interleaved
    python bench/cluster_network.py --model micro --repeats 2 --steps 4

The same job runs, alternately, as two ranks on one node (srun -N1 -n2: the ranks talk over the node's loopback)
and as two nodes of one rank each (srun -N2: over the namespaces' veth pairs and bridge), with
``train --time-collectives`` (rank 0's wait on each kind of collective per step, in the call and on its handle)
and ``keep_swap_files`` (each node's swap folder measured afterwards). The two sides differ only in where the
ranks' traffic goes: the same cores, the same disk, the same config, model and seed (their losses must be equal).

For the two-node cell it first makes the plan (``aidaptiv-ds plan --nodes 2 --gpus 1``, the framework memory as
measured by the one-node plan on this machine), runs every job with the host budget it chose, and compares its host
memory per node with the largest rank's peak RSS, and its NVMe bytes per node with each node's swap folder.

Writes OUT/rows.jsonl (one row per run), OUT/plan.json and OUT/summary.md (medians with min-max over repeats),
OUT being bench/results/cluster_network/<model> unless --out. The cluster is brought up (4 nodes) if it is not,
and taken down afterwards only then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CLUSTER = os.path.join(REPO, "scripts", "cluster.sh")
SIDES = {
    "one node, 2 ranks": ["-N1", "-n2", "--cpus-per-task=1", "--nodelist=node3"],
    "two nodes, 1 rank each": ["-N2", "--ntasks-per-node=1", "--nodelist=node1,node2"],
}


def sh(*cmd, env=None, check=True, timeout=900, cwd=None):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and r.returncode != 0:
        sys.exit(f"cluster_network: {' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def cluster_env() -> dict:
    lines = sh("bash", CLUSTER, "env").stdout
    found = dict(re.findall(r"^export (\w+)=(\S+)$", lines, re.M))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(found)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env["PYTHONPATH"] = REPO
    env["OMP_NUM_THREADS"] = "1"
    return env


def folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def swap_per_node(env: dict, swap: str, nodes: list[str]) -> dict:
    """Bytes under each node's local ``swap`` folder (its aidaptiv-swap/rank<r> files), then removed."""
    out = {}
    for node in nodes:
        path = os.path.join(env["AIDAPTIV_CLUSTER_DIR"], "nodes", node, "local", swap)
        out[node] = folder_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
    return out


def run_side(env, args, side, repeat, folder, config, budget) -> dict:
    shape = SIDES[side]
    swap = f"cn-{repeat}-{'two' if '-N2' in shape else 'one'}"
    metrics = os.path.join(folder, f"{swap}.json")
    train = [
        "python", "-m", "aidaptiv_ds", "train", "--config", config, "--model", args.model,
        "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--no-progress", "--time-collectives", "--create-nvme-path",
        "--nvme-path", os.path.join(env["AIDAPTIV_CLUSTER_LOCAL"], swap), "--metrics-out", metrics,
        "--host-budget", str(budget),
    ]  # fmt: skip
    t = time.monotonic()
    r = sh("srun", *shape, *train, env=env, check=False, cwd=folder)
    wall = time.monotonic() - t
    if r.returncode != 0:
        sys.exit(f"cluster_network: {side} exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}")
    with open(metrics) as f:
        m = json.load(f)
    nodes = ["node1", "node2"] if "-N2" in shape else ["node3"]
    return {
        "side": side,
        "repeat": repeat,
        "model": args.model,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "status": m["status"],
        "tokens_per_s": m["tokens_per_s"],
        "step_s_median": m["step_s_median"],
        "collectives_s": m.get("collectives_s"),
        "losses": m["losses"],
        "peak_rss_mb": m["peak_rss_mb"],
        "swap_bytes_per_node": swap_per_node(env, swap, nodes),
        "wall_s": wall,
    }


def make_plan(args, env) -> dict:
    """The two-node cell's plan, with the framework memory the one-node plan measures on this machine and no
    launcher's (srun starts the ranks: no deepspeed launcher process on the nodes)."""
    common = ["--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch)]
    common += ["--backend", "aidaptiv", "--dtype", "fp32", "--json"]
    here = json.loads(sh(sys.executable, "-m", "aidaptiv_ds", "plan", *common, env=env).stdout)
    framework = here["hardware"]["framework_host_bytes"]
    mem = here["hardware"]["host_mem_bytes"]
    two = sh(
        sys.executable, "-m", "aidaptiv_ds", "plan", *common, "--nodes", "2", "--gpus", "1",
        "--framework-mem", str(framework), "--launcher-mem", "0", "--host-mem", str(mem), env=env,
    )  # fmt: skip
    return json.loads(two.stdout)


def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{median(values):.4g} ({min(values):.4g}-{max(values):.4g})"


def summarize(rows, plan, out):
    lines = ["# Two nodes over the namespaces' network against two ranks on one node", ""]
    r0 = rows[0]
    lines.append(
        f"Model {r0['model']}, seq {r0['seq_len']}, micro-batch {r0['micro_batch']} per rank, {r0['steps']} steps "
        f"({r0['warmup']} left out of the medians), aidaptiv block (ds_configs/aidaptiv.json, keep_swap_files, "
        f"the host budget the plan chose: {plan['backends']['aidaptiv']['settings']['host_memory_budget'] / 2**20:.0f} "
        "MiB per rank), "
        "CPU and gloo, the real SLURM cluster of scripts/cluster.sh on this machine: both sides share its cores and "
        "disk; only the ranks' traffic differs (loopback against veth pairs and a bridge). Medians over repeats, "
        "min-max in brackets; collectives are rank 0's wait per step, in the call and on the handle "
        "(train --time-collectives)."
    )
    lines += ["", "| side | runs | tokens/s | step s | all-gather s/step | reduce-scatter s/step | all-reduce s/step |"]
    lines.append("|---|---|---|---|---|---|---|")
    by_side = {side: [r for r in rows if r["side"] == side] for side in SIDES}
    for side, runs in by_side.items():

        def coll(kind, runs=runs):
            return spread([(r["collectives_s"] or {}).get(kind, {}).get("s_per_step") for r in runs])

        lines.append(
            f"| {side} | {len(runs)} | {spread([r['tokens_per_s'] for r in runs])} | "
            f"{spread([r['step_s_median'] for r in runs])} | {coll('all_gather_into_tensor')} | "
            f"{coll('reduce_scatter_tensor')} | {coll('all_reduce')} |"
        )
    one, two = by_side["one node, 2 ranks"], by_side["two nodes, 1 rank each"]
    ratio = median(r["tokens_per_s"] for r in two) / median(r["tokens_per_s"] for r in one)
    same = all(r["losses"] == one[0]["losses"] for r in one + two)
    lines += ["", f"Two nodes make {ratio:.2f}x the tokens/s of one node; losses equal on every run: {same}."]
    aid = plan["backends"]["aidaptiv"]
    host_plan = aid["totals"]["host_per_node"] / 2**20
    nvme_plan = aid["totals"]["nvme_per_node"]
    rss = [r["peak_rss_mb"] for r in two]
    swaps = [b for r in two for b in r["swap_bytes_per_node"].values()]
    lines += [
        "",
        "**The plan of the two-node cell against what it used**",
        "",
        "`aidaptiv-ds plan --nodes 2 --gpus 1` (this machine's RAM and the framework memory its own one-node plan "
        "measured): fits "
        + str(aid["fits"])
        + "; every run ran (status "
        + ", ".join(sorted({r["status"] for r in two}))
        + ").",
        "",
        "| per node | planned | measured (median, min-max) | measured / planned |",
        "|---|---|---|---|",
        f"| host memory (MiB; measured: the largest rank's peak RSS) | {host_plan:.0f} | {spread(rss)} | "
        f"{median(rss) / host_plan:.2f} |",
        f"| NVMe (MiB; measured: the node's swap folder) | {nvme_plan / 2**20:.1f} | "
        f"{spread([b / 2**20 for b in swaps])} | {median(swaps) / nvme_plan:.2f} |",
    ]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = args.out or os.path.join(HERE, "results", "cluster_network", args.model)
    os.makedirs(out, exist_ok=True)
    was_up = subprocess.run(["bash", CLUSTER, "status"], capture_output=True).returncode == 0
    if not was_up:
        print("cluster_network: bringing the cluster up (scripts/cluster.sh up 4)", flush=True)
        sh("bash", CLUSTER, "up", "4", timeout=300)
    try:
        env = cluster_env()
        folder = os.path.join(env["AIDAPTIV_CLUSTER_SHARED"], f"cluster_network-{os.getpid()}")
        os.makedirs(folder)
        with open(os.path.join(REPO, "ds_configs", "aidaptiv.json")) as f:
            cfg = json.load(f)
        cfg["aidaptiv"]["keep_swap_files"] = True
        config = os.path.join(folder, "aidaptiv_keep.json")
        with open(config, "w") as f:
            json.dump(cfg, f)
        plan = make_plan(args, env)
        with open(os.path.join(out, "plan.json"), "w") as f:
            json.dump(plan, f, indent=1)
        # Every run with the host budget the plan chose (as `plan --write-config` writes it): the shipped "25%"
        # would give each rank of the two-node side a quarter of the machine, which the pool fills as a cache.
        budget = plan["backends"]["aidaptiv"]["settings"]["host_memory_budget"]
        rows = []
        for repeat in range(args.repeats):
            order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))  # interleaved, each side first in turn
            for side in order:
                row = run_side(env, args, side, repeat, folder, config, budget)
                rows.append(row)
                print(
                    f"cluster_network: {side} #{repeat}: {row['tokens_per_s']:.1f} tokens/s, "
                    f"collectives {json.dumps({k: round(v['s_per_step'], 3) for k, v in (row['collectives_s'] or {}).items()})}",
                    flush=True,
                )
        with open(os.path.join(out, "rows.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(summarize(rows, plan, out))
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        if not was_up:
            sh("bash", CLUSTER, "down", check=False, timeout=120)


if __name__ == "__main__":
    main()
