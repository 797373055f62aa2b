"""A run whose --metrics-out cannot be written (a full disk, often the very failure being reported) still ends in
its one status line and exit code, with the unwritable file named and where the failure came from on stderr:
no second traceback ("During handling of the above exception...") in place of the reason."""

import subprocess
import sys

from helpers import CONFIGS, REPO, child_env


def test_failed_run_with_an_unwritable_metrics_file_still_reports_why(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where --metrics-out wants a folder\n")
    metrics = blocker / "metrics.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    cmd = [sys.executable, "-m", "aidaptiv_ds", "train", "--config", f"{CONFIGS}/aidaptiv.json", "--model", "micro",
           "--steps", "1", "--nvme-path", str(swap), "--data", str(tmp_path / "missing.jsonl"), "--metrics-out",
           str(metrics), "--no-progress"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "status=error" in p.stdout and "missing.jsonl" in p.stdout, p.stdout
    assert f"cannot write --metrics-out {metrics}" in p.stderr, p.stderr
    assert "During handling of the above exception" not in p.stderr, p.stderr
