"""The supervisor of one training attempt (``python -m aidaptiv_ds.studio.supervise RUN_DIR ATTEMPT``): runs the
train command the studio wrote (argv-attemptK.json), appends its output to train.log, and writes status.json
when it starts and when it ends, so the studio can leave and come back. Started detached (its own session) by
aidaptiv_ds.studio.runs; it outlives the studio's process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from aidaptiv_ds.common.durable import write_text_atomically

KILL_AFTER_S = 30.0  # after a stop request, the train process gets this long to clean up before SIGKILL


def _write(folder: Path, status: dict) -> None:
    write_text_atomically(str(folder / "status.json"), json.dumps(status))


def main(argv: list[str]) -> int:
    folder, attempt = Path(argv[0]), int(argv[1])
    cmd = json.loads((folder / f"argv-attempt{attempt}.json").read_text())
    status = {"state": "running", "attempt": attempt, "supervisor_pid": os.getpid(), "supervisor_started": time.time()}
    # A signal to the supervisor (the studio's machine shutting down) goes on to the job; one that comes before
    # the job exists is kept and delivered as soon as it does. Installed before the job starts, so no signal
    # can kill the supervisor and leave the job without one.
    job: dict = {"pid": None, "pending": None}

    def forward(sig, _frame):
        if job["pid"] is None:
            job["pending"] = sig
            return
        try:
            os.killpg(job["pid"], sig)
        except ProcessLookupError:  # already reaped
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    with open(folder / "train.log", "ab") as log:
        log.write(f"\n===== attempt {attempt}: {' '.join(cmd)}\n".encode())
        log.flush()
        # Its own process group, so a stop interrupts the job (and any rank it starts) and nothing else.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        job["pid"] = proc.pid
        status.update(train_pid=proc.pid, train_started=time.time(), started=time.time())
        _write(folder, status)
        if job["pending"] is not None:
            forward(job["pending"], None)
        stop_seen = None  # when this supervisor first saw the stop request (clicking Stop again does not delay)
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if not (folder / "stop-requested").exists():
                    continue
                if stop_seen is None:
                    stop_seen = time.time()
                    forward(signal.SIGINT, None)
                elif time.time() - stop_seen > KILL_AFTER_S:
                    forward(signal.SIGKILL, None)
    stopped = (folder / "stop-requested").exists()
    status.update(exit_code=rc, ended=time.time())
    # A run that completed is finished even when a stop came too late to interrupt it.
    status["state"] = "finished" if rc == 0 else "stopped" if stopped else "failed"
    try:
        metrics = json.loads((folder / "metrics.json").read_text())
        if metrics.get("error") and not stopped:
            status["message"] = str(metrics["error"])
    except (OSError, json.JSONDecodeError):
        pass
    _write(folder, status)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
