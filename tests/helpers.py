"""Test helpers: where the repository is, how to run the CLI in a child process, and a read-only mount."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "ds_configs")


def child_env(**extra):
    """Environment for a child training process: this checkout first on the path, no inherited rank
    variables (a child must start as its own 1-process job or be given ranks by a launcher)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    }
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".torch_extensions"))
    # One OpenMP thread: the models are tiny, and two threads a process oversubscribe a 2-core machine as soon
    # as two ranks (or anything else) run; libgomp's spinning then made the same job take 15 to 67 s, where one
    # thread takes 14 to 17 (tests/faults/test_checkpoint_crash.py: 82 s with 2, 48 s with 1).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_train(args, cwd, timeout=600, launcher_procs=None):
    """Run `aidaptiv-ds train ARGS` (or under the deepspeed launcher with N processes); return
    (returncode, combined output)."""
    if launcher_procs:
        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        cmd = [
            deepspeed,
            "--num_accelerators",
            str(launcher_procs),
            "--master_port",
            str(_free_port()),
            "--module",
            "aidaptiv_ds",
            "train",
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", "aidaptiv_ds", "train", *args]
    p = subprocess.run(
        cmd, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    return p.returncode, p.stdout


def failure_excerpt(log, tail=2500):
    """What a failed multi-rank run's log says about why: every rank's status line and the last lines of each
    traceback (the first rank to fail is usually not the last to print), then the log's tail."""
    lines = log.splitlines()
    picked = [ln for ln in lines if "status=" in ln or "exits with return code" in ln]
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith("Traceback (most recent call last)"):
            end = i + 1
            while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end].strip()):
                end += 1
            picked += ["--- traceback ending:", *lines[max(i + 1, end - 6) : end + 1]]
    return "\n".join(["=== status lines and tracebacks", *picked, "=== log tail", log[-tail:]])


def read_metrics(path):
    with open(path) as f:
        return json.load(f)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_losses(ours, reference, rel=1e-5):
    """Two loss trajectories of the same length, step by step within ``rel`` of the reference."""
    assert len(ours) == len(reference)
    for a, b in zip(ours, reference):
        assert abs(a - b) <= rel * abs(b), (ours, reference)


def aidaptiv_config(folder, name="aidaptiv", zero=None, **block):
    """ds_configs/aidaptiv.json written to folder/<name>.json with its swap space in folder/swap (swap_<name>
    for another name, so that several configs can share a folder), ``block`` set in its "aidaptiv" block and
    ``zero`` in its zero_optimization."""
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    swap = folder / ("swap" if name == "aidaptiv" else f"swap_{name}")
    swap.mkdir(exist_ok=True)
    cfg["aidaptiv"].update(nvme_path=str(swap), **block)
    cfg["zero_optimization"].update(zero or {})
    path = folder / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def adapter_config(folder, name, budget="64MiB"):
    """ds_configs/<name> for an adapter run in ``folder``: lr 1e-2 (LoRA's B starts at zero; adapters must move
    visibly in a few steps) and, with an aidaptiv block, a swap folder of its own and ``budget``."""
    with open(os.path.join(CONFIGS, name)) as f:
        cfg = json.load(f)
    cfg["optimizer"]["params"]["lr"] = 1e-2
    if "aidaptiv" in cfg:
        (folder / "swap").mkdir()
        cfg["aidaptiv"].update(nvme_path=str(folder / "swap"), host_memory_budget=budget)
    path = folder / name
    path.write_text(json.dumps(cfg))
    return str(path)


def run_one_rank_script(script: str, args, folder, tag: str = "RESULT", timeout: int = 600):
    """Run a Python script's text as one gloo rank (its own port) in ``folder`` and return the JSON it printed on
    its last line starting with ``tag``; the run must succeed (its output is the failure's message)."""
    import json
    import subprocess
    import sys

    path = folder / "one_rank_script.py"
    path.write_text(script)
    env = child_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    p = subprocess.run(
        [sys.executable, str(path), *map(str, args)],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    return json.loads([x for x in p.stdout.splitlines() if x.startswith(tag + " ")][-1][len(tag) + 1 :])


def read_only_mount(folder) -> list:
    """A command prefix that runs a command with ``folder`` bind-mounted read-only in a mount namespace of its own
    (in a user namespace, so it needs no privilege): what refuses a write even to root (EROFS), as a read-only
    file system or bind mount does. [] where this kernel or sandbox refuses those namespaces (the caller skips)."""
    import shutil

    if not shutil.which("unshare"):
        return []
    script = f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && exec "$@"'
    wrap = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]
    try:
        # This Python must run there, and the mount refuse a file in fact (one made anyway is removed, and the
        # mount not offered).
        check = (
            "import os, sys\n"
            "probe = os.path.join(sys.argv[1], '.rw-probe')\n"
            "try:\n    open(probe, 'w').close()\nexcept OSError:\n    sys.exit(0)\n"
            "os.unlink(probe)\nsys.exit(1)\n"
        )
        probe = subprocess.run([*wrap, sys.executable, "-c", check, str(folder)], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return wrap if probe.returncode == 0 else []
