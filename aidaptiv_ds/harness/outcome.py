"""Deciding what happened to a cell: ok, oom, error or timeout, and the one line that says why (a job train's
launch guard refused as not fitting is an oom that was predicted, not measured: see REFUSED).

The metrics file alone is not trusted: a cell killed by a signal, the host-memory cap or the timeout has
none, and DeepSpeed's launcher reports a rank killed by signal N as exit code 256-N (it calls
``sys.exit(-N)``). ``classify`` combines, in this order: the timeout, the host cap's own record, the
metrics file (checked against the exit code), out-of-memory messages in the output, the exit code.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass
from typing import Optional

# train's exit code for CUDA OOM / MemoryError, and for a job its launch guard refused as not fitting (the
# contract with aidaptiv_ds/job/train.py).
OOM_EXIT_CODE = 3
# How the error of an oom outcome that train's launch guard predicted (status "refused") begins: nothing ran
# out of memory, the plan said it would (Outcome.predicted); such rows are marked inferred, like the sweep's own
# predicted-OOM skips.
REFUSED = "refused before training by the plan: "

# Messages that mean memory ran out, whatever the process then did.
_OOM_PATTERNS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"CUDA out of memory",
        r"OutOfMemoryError",
        r"\bMemoryError\b",
        r"CUDA error: out of memory",
        r"DefaultCPUAllocator: (can't|not enough memory)",
        r"Cannot allocate memory",
        r"std::bad_alloc",
        r"killed by the host memory cap",
    )
]
# Lines of DeepSpeed's launcher log and other noise that never name the error.
_NOISE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING|DEBUG)\]|^\s*$|^\s*\^+\s*$|^-+$")
_LAUNCHER_ERROR = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[ERROR\] \[launch\.py")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)|Killed|Segmentation fault)\b")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")

# Signals whose 256-N exit codes we translate back (through the deepspeed launcher).
_LAUNCHER_SIGNALS = {
    256 - s: s
    for s in (
        _signal.SIGKILL,
        _signal.SIGSEGV,
        _signal.SIGABRT,
        _signal.SIGBUS,
        _signal.SIGTERM,
        _signal.SIGINT,
        _signal.SIGFPE,
        _signal.SIGILL,
    )
}


@dataclass(frozen=True)
class Outcome:
    status: str  # ok | oom | error | timeout
    error: Optional[str]  # one line, None when ok
    signal: Optional[str] = None
    predicted: bool = False  # an oom the plan called (train's launch guard refused the job), not measured


def signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def decode_exit(returncode: Optional[int]) -> tuple[Optional[int], Optional[str]]:
    """(exit code, signal name or None). Negative Popen codes are signals; 256-N from the deepspeed launcher
    and 128+N from a shell are read as signal N too."""
    if returncode is None:
        return None, None
    if returncode < 0:
        return returncode, signal_name(-returncode)
    if returncode in _LAUNCHER_SIGNALS:
        return returncode, signal_name(_LAUNCHER_SIGNALS[returncode])
    if 128 < returncode < 160:
        return returncode, signal_name(returncode - 128)
    return returncode, None


def error_line(lines: list[str]) -> Optional[str]:
    """The line that best names the error: the last exception line (``FooError: ...``), else the last line
    that is not launcher chatter. Rank prefixes (``[rank0]:``) are dropped."""
    cleaned = [_RANK_PREFIX.sub("", ln.rstrip("\n")).strip() for ln in lines]
    for ln in reversed(cleaned):
        if _EXCEPTION.match(ln):
            return ln[:500]
    for ln in reversed(cleaned):
        if not _NOISE.match(ln) and not _LAUNCHER_ERROR.match(ln):
            return ln[:500]
    return None


_FATAL = re.compile(r"Fatal Python error: (.+)$")
_FRAME = re.compile(r'^File "(.+)", line (\d+) in (.+)$')


def fault_line(lines: list[str]) -> Optional[str]:
    """Where a native crash happened, from Python's fault handler (aidaptiv-ds enables it): "Segmentation
    fault in path:line (function)" for the innermost frame of the crashing thread, or None without a dump.
    A signal death otherwise leaves only whatever the process printed last, which names nothing."""
    cleaned = [_RANK_PREFIX.sub("", ln.rstrip("\n")).strip() for ln in lines]
    for i in range(len(cleaned) - 1, -1, -1):
        fatal = _FATAL.search(cleaned[i])  # may follow a progress bar on the same line
        if not fatal:
            continue
        for j in range(i + 1, len(cleaned)):
            if cleaned[j].startswith("Current thread"):
                frame = _FRAME.match(cleaned[j + 1]) if j + 1 < len(cleaned) else None
                if frame:
                    return f"{fatal.group(1)} in {frame.group(1)}:{frame.group(2)} ({frame.group(3)})"[:500]
                break
        return fatal.group(1)[:500]
    return None


def oom_line(lines: list[str]) -> Optional[str]:
    """The last line that says memory ran out, if any."""
    for ln in reversed(lines):
        ln = _RANK_PREFIX.sub("", ln.rstrip("\n")).strip()
        if any(p.search(ln) for p in _OOM_PATTERNS):
            return ln[:500]
    return None


def classify(
    *,
    returncode: Optional[int],
    timed_out: bool,
    timeout_s: Optional[float] = None,
    cap_kill: Optional[str] = None,
    output_tail: list[str] = (),
    metrics: Optional[dict] = None,
    metrics_problem: Optional[str] = None,
) -> Outcome:
    """Status and error line of one finished (or killed) cell.

    returncode: the launcher's Popen return code; timed_out: the harness killed the tree at the timeout;
    cap_kill: a sentence when the host-memory cap killed the tree (cgroup oom_kill or watchdog), else None;
    output_tail: last lines of stderr then stdout; metrics: train's metrics JSON, None if absent or broken;
    metrics_problem: why a metrics file that exists could not be used.
    """
    code, sig = decode_exit(returncode)
    lines = list(output_tail)
    if timed_out:
        t = f"{timeout_s:g} s" if timeout_s is not None else "the time limit"
        if metrics is not None and metrics.get("status") == "ok":
            return Outcome(
                "timeout", f"still running after {t} although metrics said ok (hung at exit?): process tree killed", sig
            )
        return Outcome("timeout", f"no result after {t}: process tree killed", sig)
    ran_ok = code == 0 and metrics is not None and metrics.get("status") == "ok"
    if cap_kill and not ran_ok:
        return Outcome("oom", cap_kill, sig)
    if metrics is not None and metrics.get("status") == "refused":
        # train's launch guard: the plan says the job cannot fit these caps, so nothing was trained. An
        # out-of-memory that was predicted, not measured (the row says so: see REFUSED).
        return Outcome(
            "oom", f"{REFUSED}{metrics.get('error') or error_line(lines) or 'no reason given'}", sig, predicted=True
        )
    if metrics is not None and metrics.get("status") in ("ok", "oom", "error"):
        st = metrics["status"]
        err = metrics.get("error") or error_line(lines)
        if st == "ok":
            if code == 0:
                return Outcome("ok", None, sig)
            how = f"killed by {sig}" if sig else f"exit code {code}"
            return Outcome("error", f"{how} after writing ok metrics: {error_line(lines) or 'no output'}", sig)
        if st == "error" and err and any(p.search(err) for p in _OOM_PATTERNS):
            return Outcome("oom", err, sig)
        return Outcome(st, err or f"train reported {st} without an error line", sig)
    oom = oom_line(lines)
    if oom:
        return Outcome("oom", oom, sig)
    if code == OOM_EXIT_CODE:
        return Outcome(
            "oom",
            f"exit code {OOM_EXIT_CODE} (train's out-of-memory exit), no metrics: {error_line(lines) or 'no output'}",
            sig,
        )
    if code == 0:
        return Outcome("error", f"exited 0 but {metrics_problem or 'wrote no metrics file'}", sig)
    if sig:
        hint = " (the kernel OOM killer?)" if sig == "SIGKILL" else ""
        last = fault_line(lines) or error_line(lines)
        return Outcome("error", f"killed by {sig}{hint}" + (f": {last}" if last else ""), sig)
    last = error_line(lines) or (metrics_problem and f"exit code {code}, {metrics_problem}")
    return Outcome("error", last or f"exit code {code}, no output", sig)
