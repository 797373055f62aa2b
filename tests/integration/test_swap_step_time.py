"""bench/swap_step_time.py on a short real cell where in-memory ZeRO-3 is not run (as at a scale whose state
exceeds the RAM): aidaptiv alone, the compute term estimated from the CPU's rates measured in the same run, the
disk measured before and after the run, the swap disk's busy share from the train job. The at-scale rows
(Qwen2.5-3B) are the bench's own runs, committed under bench/results/swap_step_time/qwen2.5-3b*."""

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, child_env


@pytest.mark.long("bench/swap_step_time.py runs it")
def test_aidaptiv_alone_is_held_to_an_estimated_bound(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(REPO, "bench", "swap_step_time.py"), "--model", "micro"]
    cmd += ["--backends", "aidaptiv", "--budget-fraction", "0.5", "--steps", "3", "--warmup", "1", "--repeats", "1"]
    cmd += ["--swap-root", str(tmp_path / "swap"), "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["backend"] for r in rows] == ["aidaptiv"]
    metrics = rows[0]["metrics"]
    assert metrics["status"] == "ok" and metrics["nvme_read_bytes"] > 0
    busy = metrics["disk_busy"]
    assert busy is None or (len(busy) == 1 and 0 <= busy[0]["fraction"] <= 1)  # None: no block device in sysfs
    bound = json.loads((out / "bound.json").read_text())  # what the bound was made of, kept beside the rows
    assert bound["disk_before"]["read_gbps"] > 0 and bound["disk_after"]["write_gbps"] > 0
    assert bound["compute_estimate"]["seconds"] > 0
    text = (out / "summary.md").read_text()
    assert "estimated (" in text and "measured in this run; in-memory ZeRO-3 cannot hold" in text
    assert "before and after the runs" in text and "x** the bound" in text
    assert "| disk busy |" in text and "aidaptiv against ZeRO-Infinity" not in text
