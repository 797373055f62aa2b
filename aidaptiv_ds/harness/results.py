"""Result rows: their schema, durable appends to DIR/results.jsonl, and reading them back.

One JSON object per line, one line per run of a cell (a grid with ``repeats`` runs each cell that many times;
rows written before repeats existed have no ``repeat`` and load as repeat 0). A row is written twice: first atomically as
DIR/cells/<cell-id>/row.json, then appended to DIR/results.jsonl with a single O_APPEND write under an
exclusive lock on DIR/results.jsonl.lock, followed by fsync. So an interrupted sweep loses at most the cell
that was running, concurrent SLURM array tasks never interleave lines, and a row whose append did not
happen (a crash in between, a file system without working locks) is still found by ``load_rows``.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from aidaptiv_ds.common.durable import fsync_path

ROW_SCHEMA = 1
RESULTS_FILE = "results.jsonl"

Status = Literal["ok", "oom", "error", "timeout"]


class HostMemCap(BaseModel):
    """How host memory was capped for a cell."""

    model_config = ConfigDict(extra="forbid")
    gb: Optional[float] = None
    """The cap in GiB for the cell's whole process tree (all ranks); None when uncapped."""
    mechanism: Optional[Literal["cgroup2", "cgroup1", "rss-watchdog"]] = None
    """cgroup2 (memory.max, memory.swap.max 0), cgroup1 (memory.limit_in_bytes, memsw) or rss-watchdog."""
    detail: Optional[str] = None
    """The cgroup path or why the cgroup could not be used."""
    oom_kills: Optional[int] = None
    """The cgroup's oom_kill count after the cell (watchdog: 1 if it killed the tree)."""


class Phases(BaseModel):
    model_config = ConfigDict(extra="allow")
    forward: Optional[float] = None
    backward: Optional[float] = None
    optimizer: Optional[float] = None
    io_wait: Optional[float] = None


class Row(BaseModel):
    """One cell's result (schema version 1). Measured values are None when unknown or when the cell failed."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = ROW_SCHEMA
    row_id: str
    """Random id of this row (rows of one cell from several runs differ in it)."""
    key: str
    """Cell id: model__backend__gG__mbB__sL__gaA."""
    repeat: int = 0
    """Which run of the cell this is (0-based; the grid's ``repeats``); absent in older rows, read as 0."""
    grid: Optional[str] = None
    aidaptiv_host_budget_bytes: Optional[int] = None
    """aidaptiv cells: the per-rank host budget the grid gave (--host-budget); None: the config's."""
    eqmem: Optional[dict] = None
    """zero_infinity_eqmem cells: how its host memory was sized to aidaptiv's budget (harness/eqmem.py
    EqmemSizing.as_row: budget_bytes, sized_bytes, over_budget_bytes, parts, max_in_cpu, ...)."""
    git_sha: Optional[str] = None
    git_dirty: Optional[bool] = None
    time_start: str
    """UTC, ISO 8601."""
    time_end: str
    wall_s: float
    """Whole cell, launcher start-up included."""
    machine: dict = Field(default_factory=dict)
    """Host, CPU, cores, RAM, GPUs, kernel, and the disk of the swap folder (see machine.py)."""

    backend: str
    model: str
    params: Optional[int] = None
    params_source: Optional[Literal["metrics", "nominal"]] = None
    micro_batch: int
    seq_len: int
    gpus: int
    nodes: int = 1
    grad_accum: int
    steps: int
    warmup: int
    lr: Optional[float] = None
    world_size: Optional[int] = None

    status: Status
    error: Optional[str] = None
    """The error's last line, or why the status was inferred."""
    inferred: bool = False
    """True when the cell was not run because a smaller cell of the same backend ran out of memory."""
    exit_code: Optional[int] = None
    signal: Optional[str] = None

    tokens_per_s: Optional[float] = None
    step_s: Optional[float] = None
    """Median step time after warm-up, seconds."""
    step_times_s: Optional[list[float]] = None
    losses: Optional[list[Optional[float]]] = None
    phases_s: Optional[Phases] = None
    peak_gpu_mb: Optional[float] = None
    peak_rss_mb: Optional[float] = None
    peak_pinned_mb: Optional[float] = None
    tree_peak_rss_mb: Optional[float] = None
    """Peak of the summed RSS of the cell's process tree, sampled by the harness."""
    cell_mem_peak_mb: Optional[float] = None
    """Peak memory charged to the cell's cgroup (page cache included), when a cgroup was used."""
    nvme_read_bytes: Optional[int] = None
    nvme_write_bytes: Optional[int] = None
    nvme_read_gbps: Optional[float] = None
    """nvme_read_bytes / total timed step time, in GB/s (1e9 bytes)."""
    nvme_write_gbps: Optional[float] = None

    gpu_mem_cap_gb: Optional[float] = None
    host_mem_cap: HostMemCap = Field(default_factory=HostMemCap)
    timeout_s: Optional[float] = None
    command: Optional[str] = None
    """The exact launch command (shell-quoted); None for inferred rows."""
    cell_dir: Optional[str] = None
    """Logs folder, relative to the results folder."""


def git_state(start: Optional[str] = None) -> tuple[Optional[str], Optional[bool]]:
    """(sha, dirty) of the checkout holding this package, or AIDAPTIV_DS_GIT_SHA, or (None, None). Changes under
    bench/results do not count: a benchmark rewriting its own committed rows is not a change to what it runs."""
    env_sha = os.environ.get("AIDAPTIV_DS_GIT_SHA")
    if env_sha:
        return env_sha, None
    where = start or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        sha = subprocess.run(
            ["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = (
            subprocess.run(
                [
                    "git",
                    "-C",
                    where,
                    "status",
                    "--porcelain",
                    "--untracked-files=no",
                    "--",
                    ".",
                    ":(exclude)bench/results",
                ],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            != ""
        )
        return sha, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def write_row_file(path: str, row: dict) -> None:
    """Write one row as its own JSON file, atomically (temporary file, fsync, rename)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(row, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def append_row(results_path: str, row: dict) -> None:
    """Append one row as one line: a single O_APPEND write under an exclusive flock, then fsync."""
    data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    created = not os.path.exists(results_path)
    with open(results_path + ".lock", "a") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        except OSError as e:
            # Some network file systems have no flock (ENOLCK, EOPNOTSUPP); O_APPEND alone still keeps each
            # line whole on local file systems, and row.json files are the fallback.
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        fd = os.open(results_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
    if created:
        fsync_path(os.path.dirname(os.path.abspath(results_path)))


@dataclass
class LoadedRows:
    rows: list[dict] = field(default_factory=list)
    """Every valid row, in file order, then rows recovered from row.json files."""
    problems: list[str] = field(default_factory=list)
    """Lines or files that could not be used, one sentence each."""
    recovered: int = 0
    """Rows found only as cells/*/row.json (their append to results.jsonl did not happen)."""

    def latest_by_key(self) -> dict[str, dict]:
        """The newest row of each cell (by time_end), whatever its repeat."""
        out: dict[str, dict] = {}
        for r in self.rows:
            if r["key"] not in out or r["time_end"] >= out[r["key"]]["time_end"]:
                out[r["key"]] = r
        return out

    def latest_by_run(self) -> dict[tuple[str, int], dict]:
        """The newest row of each run: (cell id, repeat) -> row."""
        out: dict[tuple[str, int], dict] = {}
        for r in self.rows:
            k = (r["key"], r["repeat"])
            if k not in out or r["time_end"] >= out[k]["time_end"]:
                out[k] = r
        return out


def _check(row, where: str, out: LoadedRows) -> Optional[dict]:
    try:
        return Row.model_validate(row).model_dump()
    except Exception as e:  # pydantic ValidationError, or a non-dict
        first = str(e).splitlines()[0:3]
        out.problems.append(f"{where}: not a valid row ({' '.join(first)})")
        return None


def load_rows(out_dir: str) -> LoadedRows:
    """Read DIR/results.jsonl and any DIR/cells/*/row.json not already in it. Bad lines (a line cut off by a
    crash, a row of another schema) are skipped and described in ``problems``."""
    out = LoadedRows()
    seen = set()
    path = os.path.join(out_dir, RESULTS_FILE)
    if os.path.exists(path):
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                line = raw.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    out.problems.append(f"{path} line {n}: not JSON (cut off?), skipped")
                    continue
                row = _check(obj, f"{path} line {n}", out)
                if row is not None and row["row_id"] not in seen:
                    seen.add(row["row_id"])
                    out.rows.append(row)
    for rf in sorted(glob.glob(os.path.join(out_dir, "cells", "*", "row.json"))):
        try:
            with open(rf) as f:
                obj = json.load(f)
        except (OSError, ValueError) as e:
            out.problems.append(f"{rf}: unreadable ({e}), skipped")
            continue
        row = _check(obj, rf, out)
        if row is not None and row["row_id"] not in seen:
            seen.add(row["row_id"])
            out.rows.append(row)
            out.recovered += 1
    return out
