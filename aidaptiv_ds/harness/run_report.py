"""One training run's curves (loss, tokens/s, NVMe GB/s per step) as a PNG: ``aidaptiv-ds report RUN_DIR``.

A run directory is one where ``aidaptiv-ds train`` left its per-step series: the files DeepSpeed's CSV monitor
writes for them (``aidaptiv_loss.csv``, ``aidaptiv_tokens_per_s.csv``, ... anywhere below RUN_DIR, from the
config's ``"csv_monitor"`` section; see aidaptiv_ds.common.metrics.MONITOR_SERIES), or else a ``--metrics-out``
JSON file, which holds the loss and step time of every step but no per-step I/O. The held-out loss (train
--eval-fraction/--eval-data) is drawn on the loss panel at the steps it was computed: from the CSV monitor's
``aidaptiv_eval_loss.csv``, else from the metrics JSON's ``eval_losses``. The figure goes to
``RUN_DIR/figures/run_curves.png``; a panel whose series the run did not record says so instead of a curve.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Dict, List, Optional, Tuple

from aidaptiv_ds.common.metrics import EVAL_SERIES, MONITOR_PREFIX, MONITOR_SERIES

Series = List[Tuple[float, float]]  # (step, value)


def csv_series(run_dir: str, warnings: Optional[List[str]] = None) -> Dict[str, Series]:
    """Our series from the CSV monitor's files below ``run_dir`` (by series name, steps in order), of one run.

    Runs that shared a CSV monitor folder leave several files of one series (one per job name) or one file
    whose step count starts again: plotted together they zig-zag. The most recently written file of each
    series is taken, and of it the last run (the rows after the last restart of the step count); what was left
    out is said in ``warnings``."""
    wanted = {MONITOR_PREFIX.replace("/", "_") + s + ".csv": s for s in MONITOR_SERIES + EVAL_SERIES}
    found: Dict[str, List[str]] = {}
    for root, _, files in os.walk(run_dir):
        for f in sorted(files):
            if f in wanted:
                found.setdefault(wanted[f], []).append(os.path.join(root, f))
    out: Dict[str, Series] = {}
    for name, paths in sorted(found.items()):
        path = max(paths, key=os.path.getmtime)
        if len(paths) > 1 and warnings is not None:
            warnings.append(
                f"{len(paths)} files hold the series {name} (several runs wrote below {run_dir}): plotted "
                f"{path}, the newest; give each run its own csv_monitor output_path or job_name"
            )
        with open(path, newline="") as fh:
            rows = [(float(r[0]), float(r[1])) for r in csv.reader(fh) if r and r[0] != "step"]
        starts = [i for i in range(1, len(rows)) if rows[i][0] <= rows[i - 1][0]]
        if starts and warnings is not None:
            warnings.append(
                f"{path} holds {len(starts) + 1} runs (its step count starts again {len(starts)} time(s)): "
                "plotted the last; give each run its own csv_monitor output_path or job_name"
            )
        out[name] = sorted(rows[starts[-1] :] if starts else rows)
    return out


def metrics_series(run_dir: str) -> Dict[str, Series]:
    """Loss and tokens/s per step, and the held-out loss where it was computed, from a train metrics JSON in
    ``run_dir`` (the first that has them)."""
    for f in sorted(os.listdir(run_dir)):
        if not f.endswith(".json"):
            continue
        try:
            with open(os.path.join(run_dir, f)) as fh:
                m = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(m, dict) or not m.get("losses") or not m.get("step_s"):
            continue
        first = int(m.get("first_step") or 0)
        out = {"loss": [(float(i + 1), v) for i, v in enumerate(m["losses"]) if v is not None]}
        tps = m.get("tokens_per_step")
        if tps:
            out["tokens_per_s"] = [(float(first + i + 1), tps / s) for i, s in enumerate(m["step_s"]) if s]
        evals = _eval_points(m.get("eval_losses"))
        if evals:
            out["eval_loss"] = evals
        return out
    return {}


def _eval_points(pairs) -> Series:
    """[(step, loss)] from the metrics JSON's "eval_losses" ([[step, loss], ...]); malformed pairs are skipped."""
    if not isinstance(pairs, list):
        return []
    return sorted(
        (float(p[0]), float(p[1]))
        for p in pairs
        if isinstance(p, (list, tuple))
        and len(p) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in p)
    )


def find_series(run_dir: str, warnings: Optional[List[str]] = None) -> Tuple[Dict[str, Series], Optional[str]]:
    """(series, where they came from) of a run directory; ({}, None) when it holds neither source. CSV monitor
    files of a run made before the held-out loss went to the monitor lack it: it is then taken from the
    metrics JSON beside them, when that has it. What was left out of several runs goes to ``warnings``."""
    s = csv_series(run_dir, warnings)
    if s:
        if "eval_loss" not in s:
            evals = metrics_series(run_dir).get("eval_loss")
            if evals:
                s["eval_loss"] = evals
        return s, "DeepSpeed CSV monitor files"
    s = metrics_series(run_dir)
    return (s, "metrics JSON") if s else ({}, None)


PANELS = (
    ("loss", ("loss", "eval_loss"), "loss"),
    ("tokens/s", ("tokens_per_s",), "tokens/s"),
    ("NVMe I/O (rank 0)", ("nvme_read_GBps", "nvme_write_GBps"), "GB/s"),
)


def plot(run_dir: str, series: Dict[str, Series], source: str) -> str:
    """Write RUN_DIR/figures/run_curves.png; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(7, 8), sharex=True)
    for ax, (title, names, unit) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_ylabel(unit)
        drawn = 0
        for name in names:
            pts = series.get(name)
            if pts:
                # The held-out loss has a point every --eval-every steps: bigger markers keep a single one visible.
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="s" if name == "eval_loss" else "o",
                    ms=6 if name == "eval_loss" else 3,
                    label=name,
                )
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, f"not recorded in the {source}", ha="center", va="center", transform=ax.transAxes)
        elif drawn > 1 or names[0] not in series:
            ax.legend()
    axes[-1].set_xlabel("optimizer step")
    fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))} ({source})")
    fig.tight_layout()
    os.makedirs(os.path.join(run_dir, "figures"), exist_ok=True)
    path = os.path.join(run_dir, "figures", "run_curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
