"""Helpers for sweeps with the fake trainer (tests/fakes/fake_train.py) under the real deepspeed launcher."""

import json
import os
import sys

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKES = os.path.join(ROOT, "tests", "fakes")
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def write_grid(path, **kw):
    grid = {
        "notes": "integration test grid",
        "models": ["micro"],
        "micro_batches": [1],
        "seq_lens": [8],
        "gpus": [1],
        "steps": 4,
        "warmup": 1,
        "timeout_s": 60,
        "backends": ["zero3"],
    }
    grid.update(kw)
    path.write_text(json.dumps(grid))
    return str(path)


def rows_of(out):
    with open(os.path.join(out, "results.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def leftovers(marker, ranks_only=False):
    """Processes whose command line mentions ``marker`` (a test's tmp folder); with ranks_only, only the
    fake trainer's ranks (``python -u -m fake_train ...``)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if any(marker in a for a in cmd) and (not ranks_only or cmd[1:4] == ["-u", "-m", "fake_train"]):
                found.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found
