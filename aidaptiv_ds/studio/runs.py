"""Training runs the studio launches: each one a folder under ROOT/runs, driven only through `aidaptiv-ds`
processes and the files they write, so a run outlives the page and the studio (which re-attaches to it from
its folder when it starts again).

    runs/NAME/settings.json     what the user chose (RunSettings)
    runs/NAME/plan.json         `aidaptiv-ds plan --json` of those settings
    runs/NAME/config.json       the DeepSpeed config plan wrote (--write-config), with a CSV monitor added
    runs/NAME/status.json       the supervisor's account: state, attempt, pids, exit code (written atomically)
    runs/NAME/train.log         every attempt's output, appended
    runs/NAME/monitor/attemptK/ the CSV monitor's per-step series of attempt K
    runs/NAME/checkpoints/      --save-dir (resume continues from its latest)
    runs/NAME/metrics.json      --metrics-out of the last attempt
    runs/NAME/model/            the export (merged adapters for LoRA); runs/NAME/base/ the frozen base of LoRA

A launch starts ``python -m aidaptiv_ds.studio.supervise RUN_DIR``, detached in its own session; the supervisor
starts the train command (an argument list, never a shell line), waits for it and records how it ended. Stop
writes ``stop-requested``; the supervisor then interrupts the train process once (SIGINT, so it cleans its swap
files up) and kills it if it is still there 30 s later; resume starts a new attempt with ``--resume auto``,
which continues from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from aidaptiv_ds.common.durable import write_text_atomically
from aidaptiv_ds.studio import children
from aidaptiv_ds.studio.workspace import StudioError, Workspace, safe_name

ACTIVE = ("starting", "running", "stopping")


@dataclass
class RunSettings:
    name: str
    model: str  # a preset, or an absolute model folder
    data: str  # an absolute JSONL path
    mode: str = "lora"  # "lora" or "full"
    lora_r: int = 8
    seq_len: int = 256
    micro_batch: int = 1
    epochs: float | None = None
    steps: int | None = 20
    lr: float = 1e-4
    dtype: str = "auto"  # the model's own precision where this machine computes it natively (train --dtype auto)
    nvme_path: str = ""
    host_budget: str = ""
    save_every: int = 5
    eval_fraction: float = 0.0
    seed: int = 1234

    def check(self) -> list[str]:
        problems = []
        if self.mode not in ("lora", "full"):
            problems.append(f"mode {self.mode!r} is neither lora nor full")
        for field_name in ("seq_len", "micro_batch", "save_every", "lora_r"):
            if int(getattr(self, field_name)) < 1:
                problems.append(f"{field_name.replace('_', ' ')} must be at least 1")
        if not self.steps and not self.epochs:
            problems.append("give steps or epochs (or both: whichever ends first)")
        if self.steps is not None and self.steps < 0 or self.epochs is not None and self.epochs < 0:
            problems.append("steps and epochs cannot be negative")
        if not 0 <= self.eval_fraction < 1:
            problems.append("the held-out fraction must be at least 0 and below 1")
        if not self.lr > 0:
            problems.append("the learning rate must be above 0")
        if not os.path.isfile(self.data):
            problems.append(f"data {self.data} is not a file: save a data set first")
        return problems


def plan_argv(s: RunSettings, config_out: Path) -> list[str]:
    argv = [sys.executable, "-m", "aidaptiv_ds", "plan", "--model", s.model, "--seq-len", str(s.seq_len)]
    argv += ["--micro-batch", str(s.micro_batch), "--dtype", s.dtype, "--json", "--write-config", str(config_out)]
    argv += ["--nvme-path", s.nvme_path]
    if s.host_budget:
        argv += ["--host-budget", s.host_budget]
    return argv


def train_argv(s: RunSettings, run_dir: Path, attempt: int) -> list[str]:
    argv = [sys.executable, "-m", "aidaptiv_ds", "train", "--config", str(run_dir / f"config-attempt{attempt}.json")]
    argv += ["--model", s.model, "--data", s.data, "--seq-len", str(s.seq_len), "--micro-batch", str(s.micro_batch)]
    argv += ["--lr", repr(float(s.lr)), "--seed", str(s.seed), "--dtype", s.dtype, "--nvme-path", s.nvme_path]
    # the newest two checkpoints: resume and export need one, and a run of many steps must not fill the disk
    argv += ["--save-dir", str(run_dir / "checkpoints"), "--save-every", str(s.save_every), "--keep-last", "2"]
    argv += ["--resume", "auto"]
    argv += ["--metrics-out", str(run_dir / "metrics.json"), "--no-progress"]
    if s.steps:
        argv += ["--steps", str(int(s.steps))]
    if s.epochs:
        argv += ["--epochs", repr(float(s.epochs))]
    if s.mode == "lora":
        argv += ["--lora", f"r={int(s.lora_r)},alpha={2 * int(s.lora_r)}"]
    if s.eval_fraction:
        argv += ["--eval-fraction", repr(float(s.eval_fraction)), "--eval-every", str(s.save_every)]
    if s.host_budget:
        argv += ["--host-budget", s.host_budget]
    return argv


def launch_refusal(plan: dict, mode: str) -> str | None:
    """Why the studio will not launch a job of this plan, or None. The plan counts full fine-tuning of every
    weight, so its verdict decides a full run only; a LoRA run needs the frozen base and the adapters, which
    the train job's own launch guard checks (its refusal is then the run's error): a 13B LoRA trains under
    8 GiB on a disk where full fine-tuning of 7B does not fit."""
    ours = plan["backends"].get("aidaptiv", {})
    if mode == "full" and not ours.get("fits"):
        return "the plan says aidaptiv cannot fit this job: " + "; ".join(ours.get("problems", []))
    return None


def run_plan(s: RunSettings, folder: Path, timeout_s: float = 300) -> dict:
    """`aidaptiv-ds plan --json` of the settings; its config is written to folder/config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = children.run(plan_argv(s, folder / "config.json"), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise StudioError(f"aidaptiv-ds plan took over {timeout_s:.0f} s and was stopped") from None
    if done.returncode != 0 or not done.stdout.strip().startswith("{"):
        raise StudioError(f"aidaptiv-ds plan failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    plan = json.loads(done.stdout)
    write_text_atomically(str(folder / "plan.json"), json.dumps(plan, indent=1))
    return plan


def _alive(pid: int | None, started: float | None) -> bool:
    """Whether ``pid`` is the process we started (not a later one that reused its number)."""
    if not pid:
        return False
    try:
        import psutil

        return psutil.Process(pid).create_time() <= (started or 0) + 2 and psutil.pid_exists(pid)
    except Exception:  # psutil.NoSuchProcess, AccessDenied
        return False


class Runs:
    """The runs under a workspace: launch, stop, resume, read back."""

    # Gradio runs handlers in threads: a double click or a second tab must not start one run twice, nor claim
    # one name twice.
    _lock = threading.Lock()

    def __init__(self, ws: Workspace):
        self.ws = ws

    def folder(self, name: str) -> Path:
        return self.ws.inside(Path("runs") / safe_name(name, "run name"), "run folder")

    def names(self) -> list[str]:
        found = [p.parent for p in self.ws.runs.glob("*/settings.json")]
        return [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]

    def settings(self, name: str) -> RunSettings:
        return RunSettings(**json.loads((self.folder(name) / "settings.json").read_text()))

    def status(self, name: str) -> dict:
        """The supervisor's account, corrected when its process is gone without having written the end."""
        path = self.folder(name) / "status.json"
        if not path.exists():
            return {"state": "new"}
        st = json.loads(path.read_text())
        if st.get("state") in ACTIVE and not _alive(st.get("supervisor_pid"), st.get("supervisor_started")):
            if _alive(st.get("train_pid"), st.get("train_started")):
                # The training process has its own session and outlives a killed supervisor: still running,
                # and Stop interrupts it directly.
                st["message"] = "its supervisor is gone but the training goes on: Stop interrupts it"
            else:
                st["state"] = "lost"
                st["message"] = "its supervisor and its training process are gone (the machine was stopped?): resume it"
        return st

    def busy_swap(self, nvme_path: str, except_run: str | None = None) -> str | None:
        """The run of this studio now training on ``nvme_path``, if any (the train job's own lock guards
        against every other process)."""
        for name in self.names():
            if name == except_run:
                continue
            if self.status(name).get("state") in ACTIVE and self.settings(name).nvme_path == nvme_path:
                return name
        return None

    def check_new(self, s: RunSettings) -> Path:
        """The folder of a new run with these settings; StudioError listing every problem, or naming the run
        that has this name already."""
        problems = s.check()
        if problems:
            raise StudioError("cannot launch: " + "; ".join(problems))
        folder = self.folder(s.name)
        if (folder / "settings.json").exists():
            raise StudioError(f"a run named {s.name} exists: pick another name, or resume it in the Runs tab")
        self._check_swap_free(s.nvme_path, s.name)
        return folder

    def _check_swap_free(self, nvme_path: str, run: str) -> None:
        other = self.busy_swap(nvme_path, except_run=run)
        if other:
            raise StudioError(
                f"run {other} is training on the swap folder {nvme_path}: one training at a time per swap disk; "
                "wait for it, stop it, or give this run another swap folder"
            )

    def create(self, s: RunSettings, planned: Path | None = None) -> Path:
        """The run's folder with its settings (and, from ``planned``, the plan's plan.json and config.json)."""
        with self._lock:
            folder = self.check_new(s)
            s.name = folder.name
            folder.mkdir(parents=True, exist_ok=True)
            for name in ("plan.json", "config.json") if planned else ():
                if (planned / name).exists():
                    write_text_atomically(str(folder / name), (planned / name).read_text())
            write_text_atomically(str(folder / "settings.json"), json.dumps(dataclasses.asdict(s), indent=1))
            return folder

    def launch(self, name: str, plan_config: Path | None = None) -> dict:
        """Start (or resume: the next attempt) a run's training in a detached supervisor."""
        with self._lock:
            return self._launch(name, plan_config)

    def _launch(self, name: str, plan_config: Path | None) -> dict:
        folder, s = self.folder(name), self.settings(name)
        st = self.status(name)
        if st.get("state") in ACTIVE:
            raise StudioError(f"run {name} is {st['state']}: stop it first")
        self._check_swap_free(s.nvme_path, name)
        attempt = int(st.get("attempt", 0)) + 1
        base = json.loads((plan_config or folder / "config.json").read_text())
        # Each attempt its own CSV monitor job, so a resumed attempt's steps never mix into the last one's file.
        base["csv_monitor"] = {"enabled": True, "output_path": str(folder / "monitor"), "job_name": f"attempt{attempt}"}
        write_text_atomically(str(folder / f"config-attempt{attempt}.json"), json.dumps(base, indent=1))
        (folder / "stop-requested").unlink(missing_ok=True)
        if (folder / "metrics.json").exists():  # the last attempt's figures, kept under its own name
            os.replace(folder / "metrics.json", folder / f"metrics-attempt{attempt - 1}.json")
        argv = train_argv(s, folder, attempt)
        write_text_atomically(str(folder / f"argv-attempt{attempt}.json"), json.dumps(argv))
        os.makedirs(s.nvme_path, exist_ok=True)
        now = time.time()
        write_text_atomically(
            str(folder / "status.json"),
            json.dumps({"state": "starting", "attempt": attempt, "supervisor_pid": None, "supervisor_started": now}),
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "aidaptiv_ds.studio.supervise", str(folder), str(attempt)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(folder / "supervisor.log", "a"),
            start_new_session=True,
            cwd=str(folder),
        )
        st = {"state": "starting", "attempt": attempt, "supervisor_pid": proc.pid, "supervisor_started": now}
        write_text_atomically(str(folder / "status.json"), json.dumps(st))
        return st

    def stop(self, name: str) -> str:
        folder, st = self.folder(name), self.status(name)
        if st.get("state") not in ACTIVE:
            raise StudioError(f"run {name} is {st.get('state')}, not running")
        # The supervisor sees the file within half a second and interrupts the job once (SIGINT, so it removes
        # its swap files), then kills it if it is still there 30 s later.
        (folder / "stop-requested").write_text(str(time.time()))
        if not _alive(st.get("supervisor_pid"), st.get("supervisor_started")):
            # No supervisor to see the file: interrupt the training's process group here.
            try:
                os.killpg(st["train_pid"], signal.SIGINT)
            except (KeyError, ProcessLookupError, PermissionError):
                pass
        return f"stopping {name}: its last checkpoint is kept; Resume continues from it"

    def curves(self, name: str) -> dict:
        """Every series of every attempt, merged by step (a later attempt's value wins: resumed steps are
        trained again)."""
        from aidaptiv_ds.harness.run_report import csv_series

        merged: dict = {}
        monitor = self.folder(name) / "monitor"
        attempts = sorted(monitor.glob("attempt*"), key=lambda p: int(p.name[7:]) if p.name[7:].isdigit() else 0)
        for att in attempts:
            for series, points in csv_series(str(att)).items():
                merged.setdefault(series, {}).update({int(step): value for step, value in points})
        return {k: sorted(v.items()) for k, v in merged.items()}

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.folder(name) / "train.log"
        if not path.exists():
            return ""
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self, name: str) -> dict:
        path = self.folder(name) / "metrics.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def export(self, name: str, timeout_s: float = 3600) -> list[str]:
        """The run's last checkpoint as Hugging Face folders: model/ (LoRA: adapters merged) and, for LoRA,
        base/ (the frozen base, to compare with). Returns the folders written."""
        folder, s = self.folder(name), self.settings(name)
        if self.status(name).get("state") in ACTIVE:
            raise StudioError(f"run {name} is still training: export when it has stopped or finished")
        if not (folder / "checkpoints" / "latest").exists():
            raise StudioError(f"run {name} has no checkpoint yet: let it reach a save (every {s.save_every} steps)")
        jobs = [("model", ["--merge-lora"] if s.mode == "lora" else [])]
        if s.mode == "lora":
            jobs.append(("base", []))
        written = []
        for out, extra in jobs:
            target = folder / out
            if target.exists():
                import shutil

                shutil.rmtree(target)
            argv = [sys.executable, "-m", "aidaptiv_ds", "export", str(folder / "checkpoints"), "--out", str(target)]
            done = children.run(argv + extra, timeout=timeout_s)
            if done.returncode != 0:
                raise StudioError(f"aidaptiv-ds export failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
            written.append(self.ws.relative(target))
        return written
