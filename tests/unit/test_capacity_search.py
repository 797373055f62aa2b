"""The capacity search (aidaptiv_ds/harness/capacity.py) with a fake cell runner: doubling then bisection finds
the longest length that fits with few attempts, the edge cases (nothing fits, everything fits, a grid end off
the doubling), the loss check, and the resume: a search run again over the same rows file runs nothing."""

import json
import math

import pytest

from aidaptiv_ds.harness import capacity as C
from aidaptiv_ds.harness.results import append_row


def fake_row(seq, phase, limit, key, losses=None):
    """What a cell's row says when every length up to ``limit`` fits and longer ones run out of memory."""
    fits = seq <= limit
    return {
        "attempt_key": key,
        "phase": phase,
        "seq_len": seq,
        "status": "ok" if fits else "oom",
        "error": None if fits else "killed by the host memory cap (cgroup2 limit 5.00 GiB, oom_kill count 1)",
        "losses": (losses or [9.2, 9.1]) if fits else None,
        "tokens_per_s": 1000.0 / seq if fits else None,
        "step_s": seq / 1000.0 if fits else None,
        "cell_mem_peak_mb": seq / 2.0,
        "wall_s": 1.0,
    }


def searcher(limit, log=None, calls=None):
    log = log or C.AttemptLog("/nonexistent/rows.jsonl", lambda path, row: None)
    calls = [] if calls is None else calls

    def run(seq, phase):
        calls.append((seq, phase))
        return fake_row(seq, phase, limit, f"k{seq}")

    return C.resumable(log, lambda seq: f"k{seq}", run), calls


@pytest.mark.parametrize("limit", [256, 300, 512, 2560, 3000, 5120, 12032, 16383])
def test_finds_the_longest_length_that_fits(limit):
    grid = C.seq_grid(16384)
    try_seq, calls = searcher(limit)
    r = C.search_longest(grid, try_seq)
    assert r.longest == max(s for s in grid if s <= limit)
    assert r.failed_above.seq_len == r.longest + 256 and r.failed_above.status == "oom"
    assert not r.reached_max
    # doubling to the first failure, then bisection: at most log2(64) + log2(64) + 1 attempts
    assert len(calls) <= 13 and len(set(calls)) == len(calls)
    doubling = [s for s, phase in calls if phase == "doubling"]
    assert doubling == [256 * 2**i for i in range(len(doubling))]
    assert r.at_longest.tokens_per_s == pytest.approx(1000.0 / r.longest)


def test_nothing_fits_and_everything_fits():
    grid = C.seq_grid(16384)
    r = C.search_longest(grid, searcher(100)[0])
    assert r.longest is None and r.failed_above.seq_len == 256 and len(r.attempts) == 1 and r.at_longest is None
    r = C.search_longest(grid, searcher(10**6)[0])
    assert r.longest == 16384 and r.reached_max and r.failed_above is None
    assert [a.seq_len for a in r.attempts] == [256, 512, 1024, 2048, 4096, 8192, 16384]


def test_a_grid_end_off_the_doubling_is_tried():
    grid = C.seq_grid(12288)  # doubling gives 8192, then the grid's end, 12288
    try_seq, calls = searcher(10_000)
    r = C.search_longest(grid, try_seq)
    assert [s for s, _ in calls][:6] == [256, 512, 1024, 2048, 4096, 8192] and calls[6] == (12288, "doubling")
    assert r.longest == 9984
    with pytest.raises(ValueError, match="--max-seq 100 is below the grid step 256"):
        C.seq_grid(100)


def test_a_run_with_non_finite_losses_does_not_fit():
    a = C.attempt_from_row(fake_row(512, "doubling", 1024, "k", losses=[9.0, math.nan]))
    assert not a.fits and a.status == "error" and "not all finite" in a.error and a.tokens_per_s is None
    assert C.attempt_from_row(fake_row(2048, "doubling", 1024, "k")).status == "oom"


def test_resume_runs_no_attempt_twice(tmp_path):
    path = str(tmp_path / "rows.jsonl")
    grid = C.seq_grid(8192)
    try_seq, calls = searcher(3000, C.AttemptLog(path, append_row))
    first = C.search_longest(grid, try_seq)
    assert first.longest == 2816 and len(calls) == len(first.attempts)
    with open(path) as f:
        assert [json.loads(line)["seq_len"] for line in f] == [s for s, _ in calls]

    # interrupted after three attempts: the next run does only the rest
    with open(path) as f:
        lines = f.readlines()
    part = tmp_path / "part.jsonl"
    part.write_text("".join(lines[:3]) + '{"attempt_key": "k9999", "seq_l')  # and a line cut off by a crash
    log = C.AttemptLog(str(part), append_row)
    assert len(log.problems) == 1 and "cut off" in log.problems[0]
    try_seq, again = searcher(3000, log)
    second = C.search_longest(grid, try_seq)
    assert second.longest == first.longest and [a.seq_len for a in second.attempts] == [
        a.seq_len for a in first.attempts
    ]
    assert again == calls[3:]

    # complete: nothing runs at all
    try_seq, none = searcher(3000, C.AttemptLog(path, append_row))
    assert C.search_longest(grid, try_seq).longest == first.longest and none == []


def test_summary_and_ratio():
    grid = C.seq_grid(16384)
    ours = C.Found("aidaptiv-nvme", "tiny", 1, C.search_longest(grid, searcher(12100)[0]))
    ours.confirmed[12000] = C.attempt_from_row(fake_row(12000, "confirm", 12100, "c"))
    theirs = C.Found("zero_infinity", "tiny", 1, C.search_longest(grid, searcher(2900)[0]))
    nothing = C.Found("zero_infinity", "small", 1, C.search_longest(grid, searcher(100)[0]))
    small = C.Found("aidaptiv-nvme", "small", 1, C.search_longest(grid, searcher(1000)[0]))
    table = "\n".join(C.summary_table([ours, theirs, nothing]))
    assert "| aidaptiv-nvme | tiny | 1 | 12,032 | 0.1 | 12.0 | 6,016 | 12,288: oom (killed by the host" in table
    assert "| 12,000 ok |" in table and "| zero_infinity | small | 1 | none |" in table
    ratios = "\n".join(C.ratio_lines([ours, theirs, nothing, small]))
    assert f"| tiny | 1 | aidaptiv-nvme: 12,032 | 2,816 | {12032 / 2816:.2f} |" in ratios
    assert "| small | 1 | aidaptiv-nvme: 768 | none | > 3 (zero_infinity trains no length of the grid) |" in ratios
    assert C.ratio_lines([theirs]) == ["(no model and micro-batch searched with both aidaptiv and zero_infinity)"]
