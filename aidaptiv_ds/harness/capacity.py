"""The capacity search: the longest sequence a backend trains, found by doubling then bisection, and the record
of attempts that makes a search resumable.

A search runs over a grid of sequence lengths (multiples of ``step`` up to ``max_seq``). It tries the first
length and doubles while the attempts fit (256, 512, 1024, ...; the grid's last length when doubling would
pass it); at the first attempt that does not fit it bisects between the last length that fit and that one
until they are neighbours on the grid. The answer assumes that a length fits whenever a longer one does (the
memory a step needs grows with the sequence); an attempt that breaks it (a timeout on a loaded machine, an
error) is still recorded as it happened.

An attempt is one call of ``try_seq(seq_len)``, which runs (or, resuming, looks up) the cell and returns an
:class:`Attempt`. :class:`AttemptLog` keeps every attempt of a results file by its key, so a search run again
over the same file (an interrupted sweep, a machine reboot) reruns nothing it has a row for.

Nothing here starts processes: bench/capacity_seq_len.py runs the cells through the sweep harness.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

SEQ_STEP = 256


def seq_grid(max_seq: int, step: int = SEQ_STEP) -> list[int]:
    """The lengths a search may try: step, 2 step, ... up to max_seq."""
    if step < 1 or max_seq < step:
        raise ValueError(f"--max-seq {max_seq} is below the grid step {step}: give at least {step}")
    return list(range(step, max_seq + 1, step))


@dataclass(frozen=True)
class Attempt:
    """One cell's outcome as the search needs it."""

    seq_len: int
    fits: bool
    """Trained every step with finite losses."""
    status: str
    """The harness's status (ok, oom, error, timeout); "error" too for an ok run whose loss is not finite."""
    error: Optional[str] = None
    tokens_per_s: Optional[float] = None
    step_s: Optional[float] = None
    peak_mb: Optional[float] = None
    """The cell's peak memory (the cgroup's, else the process tree's sampled RSS)."""
    phase: str = ""
    """doubling, bisection or confirm."""

    def failure(self) -> str:
        return f"{self.seq_len}: {self.status}" + (f" ({self.error})" if self.error else "")


@dataclass
class SearchResult:
    longest: Optional[int]
    """The longest length that fit (None: not even the first)."""
    failed_above: Optional[Attempt]
    """The attempt at the next grid length, which did not fit (None: the longest is the grid's end)."""
    reached_max: bool
    attempts: list[Attempt] = field(default_factory=list)
    """In the order they were asked for (looked-up ones included)."""

    @property
    def at_longest(self) -> Optional[Attempt]:
        found = [a for a in self.attempts if a.seq_len == self.longest and a.fits]
        return found[-1] if found else None


def search_longest(grid: list[int], try_seq: Callable[[int, str], Attempt]) -> SearchResult:
    """Doubling from ``grid[0]``, then bisection (see the module docstring). ``try_seq(seq_len, phase)``."""
    if not grid:
        raise ValueError("empty sequence grid")
    attempts: list[Attempt] = []

    def attempt(i: int, phase: str) -> Attempt:
        a = try_seq(grid[i], phase)
        attempts.append(a)
        return a

    last = len(grid) - 1
    ok: Optional[int] = None  # index of the longest length known to fit
    bad: Optional[int] = None  # index of the shortest length known not to fit
    bad_attempt: Optional[Attempt] = None
    i = 0
    while True:
        a = attempt(i, "doubling")
        if not a.fits:
            bad, bad_attempt = i, a
            break
        ok = i
        if i == last:
            break
        # length (i+1) * step doubled is index 2i+1
        i = min(2 * i + 1, last)
    if ok is not None and bad is not None:
        while bad - ok > 1:
            mid = (ok + bad) // 2
            a = attempt(mid, "bisection")
            if a.fits:
                ok = mid
            else:
                bad, bad_attempt = mid, a
    return SearchResult(
        longest=grid[ok] if ok is not None else None,
        failed_above=bad_attempt,
        reached_max=ok == last,
        attempts=attempts,
    )


def losses_finite(losses) -> bool:
    return bool(losses) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses)


def attempt_from_row(row: dict, phase: str = "") -> Attempt:
    """An attempt from a result row (the sweep's row fields): it fits when the cell ran ok and every loss is
    finite."""
    fits = row["status"] == "ok" and losses_finite(row.get("losses"))
    status, error = row["status"], row.get("error")
    if row["status"] == "ok" and not fits:
        status, error = "error", f"ran, but the losses are not all finite: {row.get('losses')}"
    peak = row.get("cell_mem_peak_mb") or row.get("tree_peak_rss_mb")
    return Attempt(
        seq_len=row["seq_len"],
        fits=fits,
        status=status,
        error=error,
        tokens_per_s=row.get("tokens_per_s") if fits else None,
        step_s=row.get("step_s") if fits else None,
        peak_mb=peak,
        phase=row.get("phase") or phase,
    )


def attempt_key(variant: str, model: str, micro_batch: int, seq_len: int, cap_gb: Optional[float], steps: int) -> str:
    """What makes two attempts the same experiment (the resume key)."""
    return (
        f"{variant}__{model}__mb{micro_batch}__s{seq_len}__cap{cap_gb:g}__steps{steps}"
        if cap_gb
        else f"{variant}__{model}__mb{micro_batch}__s{seq_len}__uncapped__steps{steps}"
    )


class AttemptLog:
    """The rows of one results file (JSON lines) by attempt key; new rows are appended by ``append``
    (given, so that the caller decides how a line is written: the harness's locked, fsync'ed append)."""

    def __init__(self, path: str, append: Callable[[str, dict], None]):
        self.path, self._append = path, append
        self.rows: dict[str, dict] = {}
        self.problems: list[str] = []
        if os.path.exists(path):
            with open(path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    try:
                        row = json.loads(raw)
                        self.rows[row["attempt_key"]] = row  # the last row of a key wins
                    except (ValueError, KeyError, TypeError):
                        self.problems.append(f"{path} line {n}: not a capacity row (cut off?), skipped")

    def get(self, key: str) -> Optional[dict]:
        return self.rows.get(key)

    def add(self, row: dict) -> None:
        self._append(self.path, row)
        self.rows[row["attempt_key"]] = row


def resumable(
    log: AttemptLog,
    key_of: Callable[[int], str],
    run: Callable[[int, str], dict],
    on_row: Callable[[dict, bool], None] = lambda row, reused: None,
) -> Callable[[int, str], Attempt]:
    """A ``try_seq`` that answers from ``log`` when it has the attempt's key, else calls ``run(seq, phase)``
    (which returns the row, ``attempt_key`` and ``phase`` set) and records the row."""

    def try_seq(seq_len: int, phase: str) -> Attempt:
        row = log.get(key_of(seq_len))
        reused = row is not None
        if row is None:
            row = run(seq_len, phase)
            log.add(row)
        on_row(row, reused)
        return attempt_from_row(row, phase)

    return try_seq


# ----------------------------------------------------------------------------------------------- summary


@dataclass
class Found:
    """One search's answer, for the summary."""

    variant: str
    model: str
    micro_batch: int
    result: SearchResult
    confirmed: dict = field(default_factory=dict)
    """{seq_len: Attempt} of the --confirm-seqs lengths run beside the search."""


def _fmt_seq(f: Found) -> str:
    r = f.result
    if r.longest is None:
        return "none"
    return f"{r.longest:,}" + (" (grid end)" if r.reached_max else "")


def summary_table(found: Iterable[Found]) -> list[str]:
    lines = [
        "| backend | model | micro-batch | longest sequence | tokens/s at it | step s | peak memory MiB "
        "| above it | attempts | confirmed |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for f in found:
        at = f.result.at_longest
        above = f.result.failed_above
        if above is not None:
            above_text = f"{above.seq_len:,}: {above.status}" + (f" ({above.error[:120]})" if above.error else "")
        elif f.result.reached_max:
            above_text = "not tried (grid end)"
        else:
            above_text = "-"
        conf = ", ".join(f"{s:,} {'ok' if a.fits else a.status}" for s, a in sorted(f.confirmed.items())) or "-"

        def num(v, fmt):
            return "-" if v is None else format(v, fmt)

        lines.append(
            f"| {f.variant} | {f.model} | {f.micro_batch} | {_fmt_seq(f)} | "
            f"{num(at.tokens_per_s if at else None, ',.1f')} | {num(at.step_s if at else None, '.1f')} | "
            f"{num(at.peak_mb if at else None, ',.0f')} | {above_text.replace('|', '/')} | "
            f"{len(f.result.attempts)} | {conf} |"
        )
    return lines


def ratio_lines(found: list[Found], ours_prefix: str = "aidaptiv", theirs: str = "zero_infinity") -> list[str]:
    """aidaptiv's longest sequence over ZeRO-Infinity's, per model and micro-batch (the best aidaptiv variant)."""
    lines = [f"| model | micro-batch | {ours_prefix} (best variant) | {theirs} | ratio |", "|---|---:|---|---:|---:|"]
    shapes = sorted({(f.model, f.micro_batch) for f in found}, key=lambda s: (s[0], s[1]))
    for model, mb in shapes:
        ours = [f for f in found if f.model == model and f.micro_batch == mb and f.variant.startswith(ours_prefix)]
        base = [f for f in found if f.model == model and f.micro_batch == mb and f.variant == theirs]
        if not ours or not base:
            continue
        best = max(ours, key=lambda f: f.result.longest or 0)
        a, b = best.result.longest, base[0].result.longest
        if a is None:
            ratio = "-"
        elif b is None:
            ratio = f"> {a / SEQ_STEP:g} ({theirs} trains no length of the grid)"
        else:
            ratio = f"{'>= ' if best.result.reached_max else ''}{a / b:.2f}"
        lines.append(f"| {model} | {mb} | {best.variant}: {_fmt_seq(best)} | {_fmt_seq(base[0])} | {ratio} |")
    if len(lines) == 2:
        return [f"(no model and micro-batch searched with both {ours_prefix} and {theirs})"]
    return lines
