"""The fault-injection cases: whole training jobs (`aidaptiv-ds train`, micro preset, a few steps) in child
processes, each with one fault (tests/faults/fault_job.py), each judged the same way:

- the job ends, within a time limit (no hang), by itself (no crash: exit 0 or 1, or the SIGKILL injected);
- a job that fails says why in its status line: the file, the errno and what to do (the offset too when
  a transfer failed);
- the last checkpoint is intact: resumed in a fresh process it continues the uninterrupted run's losses
  (fp32, 1e-6 relative); a job the fault does not stop gives the uninterrupted losses itself.

``data_lost`` is true when any of that fails for the bytes: a resume that does not load or drifts. Used by
the tests beside this file and by bench/faults.py, which runs every case N times for the README's table.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # tests/helpers.py, also when bench/faults.py imports this module
from helpers import read_only_mount  # noqa: E402

CONFIGS = os.path.join(REPO, "ds_configs")

STEPS, SAVE_EVERY, FAULT_STEP = 6, 2, 3  # a checkpoint at step 2; the fault in the 4th step
COMMON = ["--model", "micro", "--seq-len", "64", "--micro-batch", "2", "--warmup", "0", "--no-progress"]
BUDGET = "40MiB"  # well below the micro model's 94 MiB of state: it moves every step
JOB_TIMEOUT = 300
REL = 1e-6


def child_env() -> dict:
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
    return env


def write_config(folder: str, backend: str = "auto") -> str:
    """ds_configs/aidaptiv.json with the swap space in ``folder``/swap, the small budget, one layer a group."""
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    swap = os.path.join(folder, "swap")
    os.makedirs(swap, exist_ok=True)
    cfg["aidaptiv"].update(nvme_path=swap, host_memory_budget=BUDGET, layer_group_size=1)
    if backend != "auto":  # the default; "auto" in a config reads as an HF Trainer placeholder
        cfg["aidaptiv"]["backend"] = backend
    path = os.path.join(folder, f"aidaptiv-{backend}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


class Job:
    """One training job in a child process, with or without a fault."""

    def __init__(
        self,
        folder: str,
        config: str,
        name: str,
        fault: str = "none",
        step: int = FAULT_STEP,
        delay: float = 0.0,
        resume=False,  # True: --resume-from the save dir; "auto": --resume auto
        extra=(),  # more train arguments
        wrap=(),  # a command the job runs under (unshare, for a read-only mount of its own)
    ):
        self.metrics = os.path.join(folder, f"{name}.json")
        self.save = os.path.join(folder, "ckpt")
        args = [
            "--config",
            config,
            *COMMON,
            "--steps",
            str(STEPS),
            "--metrics-out",
            self.metrics,
            "--save-dir",
            self.save,
            "--save-every",
            str(SAVE_EVERY),
        ]
        if resume == "auto":
            args += ["--resume", "auto"]
        elif resume:
            args += ["--resume-from", self.save]
        args += list(extra)
        cmd = [*wrap, sys.executable, os.path.join(HERE, "fault_job.py"), fault, str(step), str(delay), "--", *args]
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            cmd, cwd=folder, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.rc: Optional[int] = None
        self.log = ""
        self.hang = False

    def finish(self, timeout: float = JOB_TIMEOUT) -> "Job":
        try:
            self.log, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.hang = True
            self.proc.kill()
            self.log, _ = self.proc.communicate()
        self.rc = self.proc.returncode
        self.seconds = time.time() - self.t0
        return self

    @property
    def status(self) -> str:
        lines = [ln for ln in self.log.splitlines() if ln.startswith("aidaptiv-ds train: status=")]
        return lines[-1] if lines else ""

    def losses(self) -> Optional[List[float]]:
        try:
            with open(self.metrics) as f:
                return json.load(f).get("losses")
        except (OSError, ValueError):
            return None

    def latest(self) -> Optional[str]:
        try:
            with open(os.path.join(self.save, "latest")) as f:
                return f.read().strip()
        except OSError:
            return None


def same(ours, reference) -> bool:
    return (
        ours is not None
        and len(ours) == len(reference)
        and all(abs(a - b) <= REL * abs(b) for a, b in zip(ours, reference))
    )


def error_is_clear(status: str, errno_words, names_offset: bool = True) -> bool:
    """The status line names a file of ours, the errno and what to do (and where in the file)."""
    if "status=error" not in status:
        return False
    names_file = bool(re.search(r"(\.swp|\.bin|\.pt|aidaptiv-swap|ckpt)", status))
    has_errno = any(w in status for w in errno_words)
    advice = bool(re.search(r"(: [a-z][^:]*(check|raise|free|remove|keep|choose|resume|read only))", status))
    offset = "offset" in status or not names_offset
    return names_file and has_errno and advice and offset


def reference(folder: str, fault: str = "none") -> Job:
    """The uninterrupted run every case is compared with (same model, data, seed and checkpoints); with
    fault "hold" it waits before its 4th step until ``folder``/release exists (see :func:`second_job`)."""
    return Job(folder, write_config(folder), "reference" if fault == "none" else "first", fault)


def second_job(folder: str, first: Job) -> Job:
    """While ``first`` (started with fault "hold" in ``folder``) surely holds its swap space, run a second job on
    the same nvme_path to its end; then let the first go on."""
    t0 = time.time()
    while (
        not os.path.exists(os.path.join(folder, "holding"))
        and first.proc.poll() is None
        and time.time() - t0 < JOB_TIMEOUT
    ):
        time.sleep(0.1)
    os.makedirs(os.path.join(folder, "second"), exist_ok=True)
    try:
        return Job(os.path.join(folder, "second"), write_config(folder), "second").finish()
    finally:
        open(os.path.join(folder, "release"), "w").close()


def run_case(name: str, folder: str, ref_losses: List[float], seed: int = 0) -> Dict:
    """Run one case in ``folder``; returns its row (see bench/faults.py)."""
    spec = CASES[name]
    row = {"case": name, "fault": spec["fault"], "injected": 1}
    row.update(spec["run"](folder, ref_losses, random.Random(seed)))
    row["data_lost"] = not row.get("intact", False)
    return row


def _failing(fault: str, errno_words, backend: str = "auto", names_offset: bool = True, crash_rc=(1,)):
    """A fault that must stop the job with a clear error, leaving the last checkpoint to resume from."""

    def run(folder, ref_losses, rng):
        config = write_config(folder, backend)
        # Within the step: a micro step takes 0.15-0.3 s here (a kill during the save after it is
        # tests/faults/test_checkpoint_crash.py's).
        delay = rng.uniform(0.0, 0.15) if fault == "kill9-step" else 0.0
        job = Job(folder, config, "faulty", fault, delay=delay).finish()
        row = {
            "rc": job.rc,
            "hang": job.hang,
            "crash": job.rc not in crash_rc,
            "seconds": round(job.seconds, 1),
            "status": job.status[-400:],
            "latest": job.latest(),
        }
        row["clear_error"] = fault == "kill9-step" or error_is_clear(job.status, errno_words, names_offset)
        if job.hang or row["latest"] is None:
            row["intact"] = False
            return row
        resumed = Job(folder, config, "resumed", resume=True).finish()
        done = int(row["latest"][len("step") :])
        losses = resumed.losses()
        row["resume_rc"] = resumed.rc
        row["intact"] = (
            resumed.rc == 0
            and losses is not None
            and same(losses[done:], ref_losses[done:])
            and same(losses[:done], ref_losses[:done])
        )
        if not row["intact"]:
            row["resume_log"] = resumed.log[-1500:]
        return row

    return run


def _surviving(fault: str, log_words):
    """A fault the job must ride through: it ends well, with the uninterrupted losses, and says what fell back."""

    def run(folder, ref_losses, rng):
        job = Job(folder, write_config(folder), "faulty", fault).finish()
        row = {
            "rc": job.rc,
            "hang": job.hang,
            "crash": job.rc not in (0, 1),
            "seconds": round(job.seconds, 1),
            "status": job.status[-400:],
        }
        row["clear_error"] = all(w in job.log for w in log_words)
        row["intact"] = job.rc == 0 and same(job.losses(), ref_losses)
        if not row["intact"]:
            row["log"] = job.log[-1500:]
        return row

    return run


def _two_jobs(folder, ref_losses, rng):
    """A second job on the same nvme_path while the first runs: refused at once, naming the first; the first
    finishes with the uninterrupted losses."""
    first = reference(folder, "hold")
    second = second_job(folder, first)
    first.finish()
    row = {
        "rc": second.rc,
        "hang": first.hang or second.hang,
        "crash": second.rc != 1 or first.rc != 0,
        "seconds": round(first.seconds, 1),
        "status": second.status[-400:],
    }
    row["clear_error"] = (
        f"in use by another job (pid {first.proc.pid} " in second.status and "nvme_path" in second.status
    )
    row["intact"] = first.rc == 0 and same(first.losses(), ref_losses)
    return row


class _Payload:
    """Unpickling this runs exec(): what a planted checkpoint would do (it writes ``marker``)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('the payload ran')",))


def _plant_payload(tag: str, rng, name: Optional[str] = None, marker: Optional[str] = None) -> None:
    """A pickle payload added to one of DeepSpeed's files of ``tag`` (``name``; its model_states.pt by default),
    with the tag's checksums rewritten as an attacker would, so only the data-only load stands between it and a
    run. The payload writes ``marker`` (``payload_ran`` beside the save dir by default)."""
    import glob

    import torch

    from aidaptiv_ds.swap.checkpoint_verify import write_tag_checksums

    path = os.path.join(tag, name) if name else glob.glob(os.path.join(tag, "*model_states.pt"))[0]
    sd = torch.load(path, weights_only=False)  # the test wrote it: trusted here
    sd["planted"] = _Payload(marker or os.path.join(os.path.dirname(os.path.dirname(tag)), "payload_ran"))
    torch.save(sd, path)
    write_tag_checksums(tag)


def _flip_bit(name: str):
    def damage(tag: str, rng) -> None:
        path = os.path.join(tag, "aidaptiv", "rank0", name)
        with open(os.path.join(tag, "aidaptiv", "rank0", "manifest.json")) as f:
            size = json.load(f)["params_bytes" if name == "params.bin" else "optim_bytes"]
        offset = rng.randrange(size)
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))

    return damage


def _nan_weight(tag: str, rng) -> None:
    folder = os.path.join(tag, "aidaptiv", "rank0")
    with open(os.path.join(folder, "manifest.json")) as f:
        p = rng.choice(json.load(f)["parameters"])
    with open(os.path.join(folder, "params.bin"), "r+b") as f:  # fp32: 4 bytes a value
        f.seek(p["offset"] + 4 * rng.randrange(p["partition_numel"]))
        f.write(b"\x00\x00\xc0\x7f")  # a quiet NaN


def _truncate_model_states(tag: str, rng) -> None:
    import glob

    path = glob.glob(os.path.join(tag, "*model_states.pt"))[0]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _damaged(damage: Callable, words):
    """The newest checkpoint damaged after its save: ``--resume auto`` refuses it, says which file and why,
    and resumes the one before onto the uninterrupted losses (a damaged tag never loads as a success)."""

    def run(folder, ref_losses, rng):
        config = write_config(folder)
        job = Job(folder, config, "saved").finish()
        tag = job.latest()
        row = {"rc": job.rc, "hang": job.hang, "crash": job.rc != 0, "latest": tag}
        if job.rc != 0 or tag is None:
            row.update(intact=False, clear_error=False, log=job.log[-1500:])
            return row
        damage(os.path.join(job.save, tag), rng)
        resumed = Job(folder, config, "resumed", resume="auto").finish()
        skipped = [ln for ln in resumed.log.splitlines() if "--resume auto: skipped" in ln]
        row.update(
            resume_rc=resumed.rc,
            hang=resumed.hang,
            crash=resumed.rc not in (0, 1),
            seconds=round(job.seconds + resumed.seconds, 1),
            status=(skipped[-1] if skipped else resumed.status)[-400:],
            payload_ran=os.path.exists(os.path.join(folder, "payload_ran")),
        )
        row["clear_error"] = bool(skipped) and any(w in skipped[-1] for w in words) and tag in skipped[-1]
        try:
            with open(resumed.metrics) as f:
                first_step = json.load(f).get("first_step")
        except (OSError, ValueError):
            first_step = None
        previous = int(tag[len("step") :]) - SAVE_EVERY
        row["intact"] = (
            resumed.rc == 0 and not row["payload_ran"] and first_step == previous and same(resumed.losses(), ref_losses)
        )
        if not row["intact"]:
            row["resume_log"] = resumed.log[-1500:]
        return row

    return run


def _child(argv, cwd: str) -> Dict:
    """``argv`` in a child process: its exit status (None when it hung), last line of output and seconds."""
    t0 = time.time()
    try:
        p = subprocess.run(argv, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, str(e.stderr or "")
    lines = out.strip().splitlines()
    return {"rc": rc, "last": lines[-1] if lines else "", "log": out[-1500:], "seconds": time.time() - t0}


def _command(args, cwd: str) -> Dict:
    """``aidaptiv-ds ARGS`` in a child process (see :func:`_child`)."""
    return _child([sys.executable, "-m", "aidaptiv_ds", *args], cwd)


def _planted_in_every_file(folder, ref_losses, rng):
    """A pickle payload planted in each .pt file of the newest checkpoint in turn (DeepSpeed's model and optimizer
    states), its checksums rewritten: ``--resume auto`` refuses the tag naming that file and resumes the one
    before, and the zero_to_fp32.py in the save dir, run as DeepSpeed's users run it, says to use
    ``aidaptiv-ds export``; the payload never runs."""
    import glob
    import shutil

    config = write_config(folder)
    job = Job(folder, config, "saved").finish()
    tag = job.latest()
    row = {"rc": job.rc, "hang": job.hang, "crash": job.rc != 0, "latest": tag, "injected": 0}
    if job.rc != 0 or tag is None:
        row.update(intact=False, clear_error=False, log=job.log[-1500:])
        return row
    files = sorted(
        os.path.relpath(p, os.path.join(job.save, tag)) for p in glob.glob(os.path.join(job.save, tag, "*.pt"))
    )
    row.update(injected=len(files), files=files, seconds=job.seconds)
    clear, intact, statuses = bool(files), bool(files), []
    for i, rel in enumerate(files):
        where = os.path.join(folder, f"planted{i}")
        os.makedirs(where)
        shutil.copytree(job.save, os.path.join(where, "ckpt"))
        marker = os.path.join(where, "payload_ran")
        _plant_payload(os.path.join(where, "ckpt", tag), rng, name=rel, marker=marker)
        resumed = Job(where, config, "resumed", resume="auto").finish()
        script = _child([sys.executable, os.path.join(where, "ckpt", "zero_to_fp32.py"), "ckpt", "out"], where)
        skipped = [ln for ln in resumed.log.splitlines() if "--resume auto: skipped" in ln]
        statuses.append((skipped[-1] if skipped else resumed.status)[:300])
        path = os.path.join(where, "ckpt", tag, rel)
        clear = (
            clear
            and bool(skipped)
            and f"checkpoint file {path} holds objects other than tensors" in skipped[-1]
            and "aidaptiv-ds export" in script["last"]
        )
        try:
            with open(resumed.metrics) as f:
                first_step = json.load(f).get("first_step")
        except (OSError, ValueError):
            first_step = None
        ran = os.path.exists(marker)
        row["payload_ran"] = row.get("payload_ran", False) or ran
        row["hang"] = row["hang"] or resumed.hang or script["rc"] is None
        row["crash"] = row["crash"] or resumed.rc not in (0, 1) or script["rc"] not in (0, 1)
        row["seconds"] += resumed.seconds + script["seconds"]
        ok = (
            resumed.rc == 0
            and not ran
            and script["rc"] == 1
            and first_step == int(tag[len("step") :]) - SAVE_EVERY
            and same(resumed.losses(), ref_losses)
        )
        if not ok:
            row.setdefault("resume_log", resumed.log[-1500:] + script["log"])
        intact = intact and ok
    row.update(status=" | ".join(statuses), clear_error=clear, intact=intact, seconds=round(row["seconds"], 1))
    return row


def _nan_export(folder, ref_losses, rng):
    """A NaN written into a random parameter of the newest checkpoint's params.bin: ``aidaptiv-ds export`` and
    ``aidaptiv-ds generate`` of that tag refuse it (exit 1, the file, the parameter and offset, what to do) and
    the export writes nothing; the checkpoint before it still exports."""
    config = write_config(folder)
    job = Job(folder, config, "saved").finish()
    tag = job.latest()
    row = {"rc": job.rc, "hang": job.hang, "crash": job.rc != 0, "latest": tag}
    if job.rc != 0 or tag is None:
        row.update(intact=False, clear_error=False, log=job.log[-1500:])
        return row
    damaged = os.path.join(job.save, tag)
    _nan_weight(damaged, rng)
    out = os.path.join(folder, "exported")
    export = _command(["export", damaged, "--out", out], folder)
    os.makedirs(os.path.join(folder, "generate-swap"), exist_ok=True)  # a swap folder must exist (every command)
    generate = _command(
        ["generate", "--model", damaged, "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu",
         "--nvme-path", os.path.join(folder, "generate-swap")],
        folder,
    )  # fmt: skip
    previous = os.path.join(job.save, f"step{int(tag[len('step') :]) - SAVE_EVERY}")
    good = _command(["export", previous, "--out", os.path.join(folder, "previous")], folder)
    params = os.path.join(damaged, "aidaptiv", "rank0", "params.bin")
    said = [f"checkpoint file {params} holds a non-finite value (nan) in parameter", "at byte offset"]
    row.update(
        rc=export["rc"],
        generate_rc=generate["rc"],
        hang=job.hang or None in (export["rc"], generate["rc"], good["rc"]),
        crash=any(c["rc"] not in (0, 1, None) for c in (export, generate, good)),
        seconds=round(job.seconds + export["seconds"] + generate["seconds"] + good["seconds"], 1),
        status=export["last"][-400:],
    )
    row["clear_error"] = all(
        all(w in said_last for w in said) and advice in said_last
        for said_last, advice in ((export["last"], "export another checkpoint"), (generate["last"], "generate from"))
    )
    row["intact"] = (
        export["rc"] == 1
        and generate["rc"] == 1
        and not os.path.exists(out)
        and good["rc"] == 0
        and os.path.isfile(os.path.join(folder, "previous", "model.safetensors"))
    )
    if not row["intact"]:
        row["log"] = export["log"] + generate["log"] + good["log"]
    return row


def _budgets(folder, ref_losses, rng):
    """The same job under the fault suite's 40 MiB budget and under 16 times that: the larger budget writes no
    more to the disk per step and trains the same losses (a larger budget never does worse)."""
    small = Job(folder, write_config(folder), "small").finish()
    large_cfg = os.path.join(folder, "large.json")
    with open(write_config(folder)) as f:
        cfg = json.load(f)
    cfg["aidaptiv"]["host_memory_budget"] = "640MiB"
    with open(large_cfg, "w") as f:
        json.dump(cfg, f)
    large = Job(folder, large_cfg, "large").finish()

    def written(job):
        try:
            with open(job.metrics) as f:
                m = json.load(f)
            return m["nvme_write_bytes"] / max(1, m["nvme_bytes_steps"])
        except (OSError, ValueError, KeyError):
            return None

    w_small, w_large = written(small), written(large)
    row = {
        "rc": large.rc,
        "hang": small.hang or large.hang,
        "crash": small.rc != 0 or large.rc != 0,
        "seconds": round(small.seconds + large.seconds, 1),
        "status": f"written per step: {w_small} B at 40 MiB, {w_large} B at 640 MiB",
    }
    row["clear_error"] = True  # nothing to say: both runs must simply succeed
    row["intact"] = (
        w_small is not None
        and w_large is not None
        and w_large <= w_small
        and same(small.losses(), ref_losses)
        and same(large.losses(), ref_losses)
    )
    return row


def _unwritable_output(folder, ref_losses, rng):
    """--output-dir (and --save-dir) where nothing can be written: a read-only bind mount (EROFS, refused to root
    as well) where the kernel gives the job a mount namespace, else a path through a regular file. The job is
    refused before its first step, naming the flag, the path and why; no step runs and nothing is written."""
    config = write_config(folder)
    locked = os.path.join(folder, "locked")
    os.makedirs(locked)
    wrap = read_only_mount(locked)
    if wrap:
        where, words = locked, ("read-only file system (EROFS)",)
    else:
        where = os.path.join(folder, "a-file")
        open(where, "w").close()
        words = ("is a file, not a folder",)
    out = os.path.join(where, "model")
    job = Job(folder, config, "refused", extra=["--output-dir", out], wrap=wrap).finish()
    try:
        with open(job.metrics) as f:
            m = json.load(f)
    except (OSError, ValueError):
        m = {}
    row = {
        "rc": job.rc,
        "hang": job.hang,
        "crash": job.rc != 1,
        "seconds": round(job.seconds, 1),
        "status": job.status[-400:],
        "how": "read-only bind mount" if wrap else "a path through a regular file",
    }
    row["clear_error"] = f"--output-dir {out}" in job.status and any(w in job.status for w in words)
    # Refused before training: no step ran (no loss), nothing was saved, nothing was made where it was refused.
    row["intact"] = m.get("status") == "error" and not m.get("losses") and job.latest() is None
    row["intact"] = row["intact"] and os.listdir(locked) == [] and not os.path.exists(job.save)
    if not row["intact"]:
        row["log"] = job.log[-1500:]
    return row


def _rebinding_request(folder, ref_losses, rng):
    """A web page whose name resolves to 127.0.0.1 (DNS rebinding), and a foreign page posting to 127.0.0.1: the
    studio, started as a user starts it with a data set in its root, refuses both before Gradio answers (no
    page, no config, no grant to the other origin) and still serves its own page."""
    import http.client
    import socket

    root = os.path.join(folder, "studio")
    os.makedirs(os.path.join(root, "data"))
    with open(os.path.join(root, "data", "secret-set.jsonl"), "w") as f:
        f.write(json.dumps({"instruction": "secret?", "response": "secret-answer"}) + "\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    evil = "evil.example"
    t0 = time.time()
    with open(os.path.join(folder, "studio.log"), "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aidaptiv_ds", "studio", "--root", root, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def ask(method, path, headers, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace")
        finally:
            conn.close()

    answers, hang = {}, False
    try:
        while True:
            if proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() - t0 > JOB_TIMEOUT:
                    hang = True
                    break
                time.sleep(0.5)
        if proc.poll() is None and not hang:
            own = f"127.0.0.1:{port}"
            answers["rebinding config"] = ask("GET", "/config", {"Host": f"{evil}:{port}"})
            answers["rebinding page"] = ask("GET", "/", {"Host": f"{evil}:{port}"})
            answers["foreign origin"] = ask(
                "POST",
                "/gradio_api/call/on_load",
                {"Host": own, "Origin": f"http://{evil}", "Content-Type": "application/json"},
                json.dumps({"data": []}),
            )
            answers["own page"] = ask("GET", "/config", {"Host": own})
    finally:
        crashed = proc.poll() is not None
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            hang = True
    refused = [k for k in ("rebinding config", "rebinding page", "foreign origin") if k in answers]
    refused = [k for k in refused if answers[k][0] in (403, 421)]
    leaked = [
        k
        for k, (_, headers, body) in answers.items()
        if k != "own page" and ("secret-set" in body or "access-control-allow-origin" in headers)
    ]
    own_ok = "own page" in answers and answers["own page"][0] == 200 and "secret-set" in answers["own page"][2]
    row = {
        "rc": 0 if own_ok else 1,
        "hang": hang,
        "crash": crashed,
        "seconds": round(time.time() - t0, 1),
        "status": "; ".join(f"{k}: {v[0]} {v[2][:80]!r}" for k, v in answers.items())[-400:],
    }
    row["clear_error"] = len(refused) == 3
    row["intact"] = len(refused) == 3 and not leaked and own_ok
    if not row["intact"]:
        with open(os.path.join(folder, "studio.log")) as f:
            row["log"] = f.read()[-1500:]
    return row


CASES: Dict[str, Dict[str, Callable]] = {
    "eio-read": {
        "fault": "EIO on every read from step 4 (posix backend, seccomp)",
        "run": _failing("eio-read", ("EIO", "Input/output error"), backend="posix"),
    },
    "eio-write": {
        "fault": "EIO on every write from step 4's optimizer step (posix backend, seccomp)",
        "run": _failing("eio-write", ("EIO", "Input/output error"), backend="posix"),
    },
    "disk-full-step": {
        "fault": "file-size limit (ulimit -f 1 MiB) reached in step 4's optimizer step",
        "run": _failing("fsize-step", ("EFBIG", "File too large")),
    },
    "disk-full-save": {
        "fault": "file-size limit (ulimit -f 64 KiB) reached while saving step 4",
        "run": _failing("fsize-save", ("EFBIG", "File too large"), names_offset=False),
    },
    "kill9-step": {
        "fault": "SIGKILL at a random point (0-0.15 s) into step 4",
        "run": _failing("kill9-step", (), crash_rc=(-9,)),
    },
    "truncated-swap": {
        "fault": "parameter swap file truncated to 0 bytes before step 4",
        "run": _failing("truncate-swap", ("ENODATA", "end of file", "truncated")),
    },
    "deleted-swap": {
        "fault": "swap files unlinked before step 4 (open files live on)",
        "run": _surviving("delete-swap", ()),
    },
    "memlock-refused": {
        "fault": "mlock and io_uring buffer registration refused (ENOMEM) from the start",
        "run": _surviving("no-memlock", ("page-locking the pinned pool",)),
    },
    "io_uring-refused": {
        "fault": "io_uring_setup refused (EPERM) from the start: posix fallback",
        "run": _surviving("no-uring", ("posix",)),
    },
    "both-refused": {
        "fault": "mlock, io_uring buffer registration and io_uring_setup all refused from the start",
        "run": _surviving("no-memlock+no-uring", ("page-locking the pinned pool", "posix")),
    },
    "two-jobs": {"fault": "a second job on the same nvme_path and rank while the first runs", "run": _two_jobs},
    "planted-payload": {
        "fault": "a pickle payload planted in the newest checkpoint's model_states.pt, its checksums rewritten",
        "run": _damaged(_plant_payload, ("holds objects other than tensors",)),
    },
    "planted-payload-every-file": {
        "fault": "a pickle payload planted in each .pt file of the newest checkpoint in turn (model and optimizer "
        "states), its checksums rewritten; resumed, and its save dir's zero_to_fp32.py run",
        "run": _planted_in_every_file,
    },
    "flipped-params": {
        "fault": "one bit flipped at a random offset of the newest checkpoint's params.bin",
        "run": _damaged(_flip_bit("params.bin"), ("do not match the checksum", "non-finite")),
    },
    "flipped-optim": {
        "fault": "one bit flipped at a random offset of the newest checkpoint's optim.bin",
        "run": _damaged(_flip_bit("optim.bin"), ("do not match the checksum", "non-finite")),
    },
    "nan-weights": {
        "fault": "a NaN written into a random parameter of the newest checkpoint's params.bin",
        "run": _damaged(_nan_weight, ("non-finite value (nan)",)),
    },
    "nan-export": {
        "fault": "a NaN written into a random parameter of the newest checkpoint's params.bin, then `aidaptiv-ds "
        "export` and `generate` of it",
        "run": _nan_export,
    },
    "damaged-model-states": {
        "fault": "the newest checkpoint's model_states.pt cut to half its size",
        "run": _damaged(_truncate_model_states, ("is not what its save wrote", "cannot be read")),
    },
    "unwritable-output": {
        "fault": "--output-dir on a read-only bind mount (EROFS; a path through a regular file where the kernel "
        "refuses mount namespaces): refused before the first step",
        "run": _unwritable_output,
    },
    "rebinding-request": {
        "fault": "requests to the studio from a page whose name resolves to 127.0.0.1 (DNS rebinding) and from "
        "another origin: refused (403/421), nothing of the root in the answer; its own page still served",
        "run": _rebinding_request,
    },
    "budget-monotonicity": {
        "fault": "none: the same job under a 16 times larger host budget",
        "run": _budgets,
    },
}


def concurrent_swaps(folder: str, seed: int = 0, threads: int = 8, per_thread: int = 16) -> Dict:
    """``threads`` x ``per_thread`` extents of odd sizes in one swap file, each written, read back, rewritten
    and read again, all in flight together through the swap store (whose hazard tracking must order each
    read after the write before it): every read must be byte-equal to what was written just before."""
    import threading

    import torch

    from aidaptiv_ds.engine.io import IOEngine, PinnedPool
    from aidaptiv_ds.swap.host_memory import HostMemory
    from aidaptiv_ds.swap.space import SwapSpace
    from aidaptiv_ds.swap.store import SwapStore

    t0 = time.time()
    space = SwapSpace(folder, rank=0)
    engine = IOEngine(pool=None)
    store = SwapStore(engine, space)
    f = space.create_file("params.swp", engine)
    memory = HostMemory(PinnedPool(256 << 20))
    rng = random.Random(seed)
    sizes = [[4096 * rng.randint(1, 24) + rng.randint(0, 4095) for _ in range(per_thread)] for _ in range(threads)]
    extents = [[f.allocate(n) for n in row] for row in sizes]
    mismatches, errors = [], []
    start = threading.Barrier(threads)

    def worker(t):
        try:
            gen = torch.Generator().manual_seed(seed * 1000 + t)
            start.wait()
            work = []
            for i, ext in enumerate(extents[t]):
                n = ext.nbytes
                first, second = (torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for _ in range(2))
                w1, r1, w2, r2 = (memory.take(n, "test") for _ in range(4))
                w1.copy_(first)
                w2.copy_(second)
                tickets = [
                    store.write_span(f, ext.offset, w1),
                    store.read_span(f, ext.offset, r1),
                    store.write_span(f, ext.offset, w2),
                    store.read_span(f, ext.offset, r2),
                ]
                work.append((i, tickets, (first, r1), (second, r2), (w1, w2)))
            for i, tickets, (a, ra), (b, rb), _ in work:
                for tk in tickets:
                    store.wait(tk)
                if not torch.equal(ra, a) or not torch.equal(rb, b):
                    mismatches.append((t, i))
        except Exception as e:  # reported in the row, never lost in a thread
            errors.append(f"thread {t}: {e}")

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(timeout=JOB_TIMEOUT)
    hang = any(th.is_alive() for th in pool)
    if not hang:
        store.drain()
        space.close()
        engine.shutdown()
    swaps = threads * per_thread
    return {
        "case": "concurrent-swaps",
        "fault": f"{swaps} swaps (write, read, rewrite, read) in flight at once "
        f"from {threads} threads through the swap store",
        "injected": swaps,
        "hang": hang,
        "crash": bool(errors),
        "clear_error": True,
        "mismatches": len(mismatches),
        "errors": errors[:3],
        "intact": not mismatches and not errors and not hang,
        "data_lost": bool(mismatches or errors or hang),
        "seconds": round(time.time() - t0, 1),
    }
