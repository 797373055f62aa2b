"""The planner against every committed sweep row (bench/plan_accuracy.py): its committed comparison is what the
code gives with the committed rates, and its feasibility and peak host memory meet the issue's targets.

Tokens/s does not (see bench/results/plan_accuracy/summary.md): on these CPU cells most of a step is
DeepSpeed's per-step work that the FLOP and Adam rates do not see, so that target is reported, not asserted."""
import importlib.util
import json
import os

import pytest

from helpers import REPO

RESULTS = os.path.join(REPO, "bench", "results", "plan_accuracy")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("plan_accuracy", os.path.join(REPO, "bench", "plan_accuracy.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results(bench):
    rates = bench.rates_from(os.path.join(RESULTS, "rates.json"))
    return [bench.compare(row, rates) for row in bench.load_rows()]


def test_committed_comparison_is_what_the_planner_gives(results):
    with open(os.path.join(RESULTS, "rows.jsonl")) as f:
        committed = [json.loads(line) for line in f if line.strip()]
    assert [r["key"] for r in results] == [r["key"] for r in committed]   # every row compared, none new
    for ours, theirs in zip(results, committed):
        assert ours["predicted_fits"] == theirs["predicted_fits"], ours["key"]
        assert ours["host_predicted_mb"] == pytest.approx(theirs["host_predicted_mb"], rel=1e-9), ours["key"]
        assert ours["tokens_per_s_predicted"] == pytest.approx(theirs["tokens_per_s_predicted"], rel=1e-9)


def test_feasibility_and_host_memory_meet_the_targets(bench, results):
    summary = bench.summarize(results)
    assert summary["feasibility_right"] >= 0.95, summary["feasibility_misses"]
    assert summary["host_within_15pct"] >= 0.80, summary["host_misses"]
