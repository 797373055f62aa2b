"""Tables and plots from a sweep's results.jsonl (DIR/report.md, DIR/figures/*.png), or one training run's
curves (DIR/figures/run_curves.png).

  aidaptiv-ds report bench/results/cpu_small/xeon
  aidaptiv-ds report runs/my-run --no-plots

See aidaptiv_ds.harness.report for what the report holds and where each figure comes from.
"""

from __future__ import annotations

import argparse
import os
import sys

from aidaptiv_ds.harness.report import build_report
from aidaptiv_ds.harness.results import RESULTS_FILE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir",
        help="a sweep's results folder (with results.jsonl), or one train run's folder (with the "
        "CSV monitor's aidaptiv_*.csv files or a --metrics-out JSON)",
    )
    p.add_argument("--no-plots", action="store_true", help="tables only, no PNGs")


def run(args: argparse.Namespace) -> int:
    if os.path.isdir(args.dir) and not os.path.exists(os.path.join(args.dir, RESULTS_FILE)):
        from aidaptiv_ds.harness import run_report

        warnings: list = []
        series, source = run_report.find_series(args.dir, warnings)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        if series:  # one run's folder; a folder with neither gets the sweep's "no usable rows" below
            from aidaptiv_ds.common.extras import missing, missing_message

            if missing("matplotlib"):  # a run's report is its plot
                why = missing_message("a run folder's plot", ["matplotlib"])
                print(f"error: {why}", file=sys.stderr)
                return 2
            path = run_report.plot(args.dir, series, source)
            print(f"wrote {path} ({', '.join(sorted(series))} from the {source})", file=sys.stderr)
            return 0
    try:
        md, figures = build_report(args.dir, plots=not args.no_plots)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = os.path.join(args.dir, "report.md")
    with open(path, "w") as f:
        f.write(md)
    print(
        f"wrote {path}" + (f" and {len(figures)} figure(s) in {os.path.join(args.dir, 'figures')}" if figures else ""),
        file=sys.stderr,
    )
    return 0
