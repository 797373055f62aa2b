"""Running one cell as its own process tree, and always getting it back.

The launcher starts in a new session (so its ranks share one process group), inside the cell's memory
cgroup when there is one, with stdout and stderr going to files in the cell folder. The harness polls it
every 0.1 s: past the timeout the tree gets SIGTERM, then SIGKILL after a short grace; with the RSS watchdog
over the cap it gets SIGKILL at once. Whatever happens, including Ctrl-C or SIGTERM to the sweep, the
process group, every descendant seen while sampling and everything left in the cgroup are killed before
``run_cell`` returns or raises.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import psutil

from aidaptiv_ds.harness.hostcap import CellCgroup

TAIL_BYTES = 64 * 1024  # read back for classification
KEEP_LOG_BYTES = 512 * 1024  # kept of each log in the cell folder
TERM_GRACE_S = 3.0


@dataclass
class CellRun:
    returncode: Optional[int] = None
    timed_out: bool = False
    cap_kill: Optional[str] = None
    wall_s: float = 0.0
    tree_peak_rss_bytes: int = 0
    cgroup_peak_bytes: Optional[int] = None
    oom_kills: Optional[int] = None
    output_tail: list[str] = field(default_factory=list)
    metrics: Optional[dict] = None
    metrics_problem: Optional[str] = None


class _Tree:
    """The launcher and every descendant seen so far (psutil handles, so a reused pid is never signalled)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.known: dict[int, psutil.Process] = {}
        try:
            self.known[proc.pid] = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            pass

    def rss(self) -> int:
        """Summed RSS of the live tree, refreshing the set of known descendants."""
        total = 0
        try:
            root = psutil.Process(self.proc.pid)
            members = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            members = list(self.known.values())
        for p in members:
            self.known.setdefault(p.pid, p)
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def signal(self, sig: int, group: bool = True) -> None:
        """Signal the process group (only while the launcher is not yet reaped: until then its pid, which is
        the group id, cannot be reused) and every known descendant."""
        if group:
            try:
                os.killpg(self.proc.pid, sig)  # the launcher is a session leader: pgid == its pid
            except (ProcessLookupError, PermissionError):
                pass
        try:
            extra = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            extra = []
        for p in list(self.known.values()) + extra:
            try:
                p.send_signal(sig)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def kill(self, grace_s: float = 0.0) -> None:
        if grace_s > 0:
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and not _exited(self.proc.pid):
                time.sleep(0.05)
        self.signal(signal.SIGKILL)


def _exited(pid: int) -> bool:
    """Whether the launcher has exited, without reaping it (WNOWAIT), so its group id stays ours."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _tail(path: str, nbytes: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[1:] if size > nbytes else lines  # the first line may be cut


def _trim(path: str, keep: int) -> None:
    """Keep only the last ``keep`` bytes of a log."""
    try:
        size = os.path.getsize(path)
        if size <= keep:
            return
        with open(path, "rb") as f:
            f.seek(size - keep)
            data = f.read()
        with open(path, "wb") as f:
            f.write(f"[... {size - keep} earlier bytes dropped by the harness ...]\n".encode() + data)
    except OSError:
        pass


def read_metrics(path: str) -> tuple[Optional[dict], Optional[str]]:
    if not os.path.exists(path):
        return None, None
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"metrics file {os.path.basename(path)} is unreadable ({e})"
    if not isinstance(m, dict):
        return None, f"metrics file {os.path.basename(path)} is not a JSON object"
    return m, None


def run_cell(
    cmd: list[str],
    *,
    cell_dir: str,
    metrics_path: str,
    timeout_s: float,
    env: dict,
    cwd: Optional[str] = None,
    cap_bytes: Optional[int] = None,
    cgroup: Optional[CellCgroup] = None,
    watchdog: bool = False,
    poll_s: float = 0.1,
    tick: Optional[Callable[[float], None]] = None,
) -> CellRun:
    """Run one cell's command to completion, timeout or cap. ``cgroup``: the cell's memory cgroup (already
    limited), or None; ``watchdog``: enforce ``cap_bytes`` by sampling RSS instead."""
    run = CellRun()
    out_path, err_path = os.path.join(cell_dir, "stdout.log"), os.path.join(cell_dir, "stderr.log")
    launch = cgroup.wrap(cmd) if cgroup is not None else cmd
    t0 = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            launch, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd, env=env, start_new_session=True
        )
    tree = _Tree(proc)
    sample_every = poll_s if watchdog else max(poll_s, 0.5)
    next_sample = 0.0
    try:
        while True:
            if _exited(proc.pid):
                break
            now = time.monotonic() - t0
            if now >= timeout_s:
                run.timed_out = True
                tree.kill(grace_s=TERM_GRACE_S)
                break
            if now >= next_sample:
                next_sample = now + sample_every
                rss = tree.rss()
                run.tree_peak_rss_bytes = max(run.tree_peak_rss_bytes, rss)
                if watchdog and cap_bytes is not None and rss > cap_bytes:
                    tree.kill()
                    run.cap_kill = (
                        f"killed by the host memory cap (rss-watchdog): process tree RSS "
                        f"{rss / 2**30:.2f} GiB > cap {cap_bytes / 2**30:.2f} GiB"
                    )
                    break
            if tick is not None:
                tick(now)
            time.sleep(poll_s)
    finally:
        # Also on KeyboardInterrupt / SystemExit: nothing of the cell may outlive this call.
        tree.kill()  # the group and its stragglers, before the launcher is reaped
        try:
            run.returncode = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            run.returncode = None
        tree.signal(signal.SIGKILL, group=False)
        if cgroup is not None:
            run.oom_kills = cgroup.oom_kills()
            run.cgroup_peak_bytes = cgroup.peak_bytes()
            try:
                cgroup.remove()
            except OSError:
                pass
        run.wall_s = time.monotonic() - t0
    if cgroup is not None and run.oom_kills:
        run.cap_kill = (
            f"killed by the host memory cap ({cgroup.kind} limit {cgroup.limit_bytes / 2**30:.2f} GiB"
            f", oom_kill count {run.oom_kills})"
        )
    elif watchdog and run.cap_kill:
        run.oom_kills = 1
    run.output_tail = _tail(out_path, TAIL_BYTES) + _tail(err_path, TAIL_BYTES)
    for p in (out_path, err_path):
        _trim(p, KEEP_LOG_BYTES)
    run.metrics, run.metrics_problem = read_metrics(metrics_path)
    return run
