"""The planner against every committed sweep row (bench/plan_accuracy.py): the committed comparison is what the
code gives with the committed rates, it meets the issue's targets (feasibility right in >= 95% of cells, peak
host memory within 15% in >= 80% of ok cells, tokens/s within 30% in >= 80% of the sweeps' ok 1-rank cells), and
NVMe bytes per step are predicted within 20% where the timed steps are steady. A change to the planner's model that loses accuracy on the committed rows fails here; new rows or
rates are committed together with a re-run of bench/plan_accuracy.py."""

import importlib.util
import json
import os

import pytest
from helpers import REPO

RESULTS = os.path.join(REPO, "bench", "results", "plan_accuracy", "cpu_sweeps")


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
    assert [r["key"] for r in results] == [r["key"] for r in committed]  # every row compared, none new
    for ours, theirs in zip(results, committed):
        assert ours["predicted_fits"] == theirs["predicted_fits"], ours["key"]
        assert ours["host_predicted_mb"] == pytest.approx(theirs["host_predicted_mb"], rel=1e-9), ours["key"]
        assert ours["tokens_per_s_predicted"] == pytest.approx(theirs["tokens_per_s_predicted"], rel=1e-9)


def test_the_committed_comparison_meets_the_targets(bench, results):
    summary = bench.summarize(results)
    assert summary["ok_cells"] >= 25 and summary["cells"] >= 30  # every sweep and backend
    assert summary["feasibility_right"] >= 0.95, summary["feasibility_misses"]
    assert summary["host_within_15pct"] >= 0.80, summary["host_misses"]
    assert summary["tokens_within_30pct"] >= 0.80, summary["tokens_misses"]  # the sweeps' 1-rank cells
    # With more ranks the model leaves collectives out: those cells may run slower, never much faster.
    assert summary["tokens_cells_more_ranks"] >= 8 and not summary["tokens_faster_than_predicted_more_ranks"]


def test_the_plan_holds_host_memory_at_scale(bench, results):
    """capacity_models/cap_8gib's aidaptiv cells, 58M to 3.09B parameters under an 8 GiB cap: the plan counted a step
    transient per parameter of the model there (28.7 GiB for a 3B run that peaked at 7.2)."""
    at_scale = [r for r in results if r["sweep"] == "capacity_models/cap_8gib" and r["status"] == "ok"]
    assert {r["key"].split("__")[0] for r in at_scale} >= {"tinyllama-1.1b", "qwen2.5-3b"}
    assert all(abs(r["host_error"]) <= 0.05 for r in at_scale), {r["key"]: r["host_error"] for r in at_scale}


def test_nvme_bytes_per_step_within_20_percent(bench, results):
    errors = bench.summarize(results)["nvme_bytes_error"]
    assert len(errors) >= 7  # every ok zero_infinity and aidaptiv cell of cpu_small read from NVMe
    assert all(abs(e) <= 0.20 for v in errors.values() for e in v.values()), errors


def test_rows_from_another_machine_are_counted_apart(bench, results):
    rows = bench.load_rows()
    assert bench.rates_cpu("cpu:AMD EPYC 7B13:2:fp32") == "AMD EPYC 7B13"
    timed = lambda cpu: sum(
        1
        for r, row in zip(results, rows)
        if "tokens_error" in r and row["machine"]["cpu"] == cpu and r["sweep"] in bench.SWEEPS
    )
    cpus = sorted({row["machine"]["cpu"] for row in rows})
    assert len(cpus) == 2 and all(timed(c) > 0 for c in cpus)  # cpu_small/xeon on an Intel Xeon, cpu_small/epyc here
    for cpu in cpus:
        bench.mark_machines(results, rows, cpu)
        summary = bench.summarize(results)
        others = sum(timed(c) for c in cpus if c != cpu)
        assert summary["tokens_cells_same_machine"] == timed(cpu) and summary["tokens_cells_other_machine"] == others
