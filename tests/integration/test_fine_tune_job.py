"""The training job beyond a benchmark loop, on the micro preset: --epochs with a held-out split evaluated every
few steps (metrics and the CSV monitor), a cosine schedule with warm-up, and --resume auto continuing a
linear schedule and the evaluation exactly where an interrupted run with our swapper left off."""

import csv
import json
import math
import os

import pytest
from helpers import CONFIGS, read_metrics, run_train

COMMON = ["--model", "micro", "--seq-len", "64", "--warmup", "0", "--no-progress"]
LR = 1e-3


def reference_factor(schedule, step, warmup, total):
    """transformers' schedules, written out: the lr multiplier of 0-based optimizer step ``step``."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 1.0 - progress) if schedule == "linear" else max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


def test_epochs_with_held_out_loss_and_a_cosine_schedule(tmp_path):
    with open(os.path.join(CONFIGS, "zero3.json")) as f:
        cfg = json.load(f)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    rc, log = run_train(
        [
            "--config",
            str(tmp_path / "c.json"),
            *COMMON,
            "--micro-batch",
            "8",
            "--epochs",
            "0.1",
            "--eval-fraction",
            "0.1",
            "--eval-every",
            "3",
            "--lr-schedule",
            "cosine",
            "--warmup-steps",
            "2",
            "--lr",
            str(LR),
            "--metrics-out",
            str(tmp_path / "m.json"),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    assert "lr_scheduler.step()" not in log, log[-3000:]  # PyTorch's false warning is not printed
    m = read_metrics(tmp_path / "m.json")
    steps = math.ceil(0.1 * m["epoch_tokens"] / m["tokens_per_step"])
    assert m["steps"] == steps == len(m["losses"]) and 0.1 <= m["epochs_done"] < 0.1 + 1 / m["steps_per_epoch"]
    assert m["eval_records"] == round(0.1 * (m["train_records"] + m["eval_records"]))
    assert [s for s, _ in m["eval_losses"]] == [s for s in range(1, steps + 1) if s % 3 == 0 or s == steps]
    assert m["eval_losses"][-1][1] == m["eval_loss"] < m["eval_losses"][0][1]  # it learns
    assert m["lrs"] == pytest.approx(
        [LR * reference_factor("cosine", s, 2, steps) for s in range(steps)], rel=1e-9, abs=1e-15
    )
    with open(tmp_path / "csv" / "job" / "aidaptiv_eval_loss.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "eval_loss"]
    assert [int(s) for s, _ in rows[1:]] == [s for s, _ in m["eval_losses"]]
    assert [float(v) for _, v in rows[1:]] == pytest.approx([v for _, v in m["eval_losses"]], rel=1e-12)


def test_resume_auto_continues_the_schedule_and_the_evaluation(tmp_path):
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    (tmp_path / "swap").mkdir()
    cfg["aidaptiv"].update(nvme_path=str(tmp_path / "swap"), host_memory_budget="40MiB", layer_group_size=1)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    ck = tmp_path / "ck"

    def train(name):
        rc, log = run_train(
            [
                "--config",
                str(tmp_path / "c.json"),
                *COMMON,
                "--steps",
                "5",
                "--save-dir",
                str(ck),
                "--save-every",
                "2",
                "--resume",
                "auto",
                "--lr-schedule",
                "linear",
                "--warmup-steps",
                "2",
                "--lr",
                str(LR),
                "--eval-fraction",
                "0.1",
                "--eval-every",
                "2",
                "--metrics-out",
                str(tmp_path / name),
            ],
            cwd=tmp_path,
        )
        assert rc == 0, log[-3000:]
        return read_metrics(tmp_path / name), log

    full, log = train("full.json")
    assert "no checkpoint in" in log and "starting from step 0" in log
    # The save and evaluation at step 2 come before the timed window (warm-up 2): their bytes are not taken
    # out of it (they once were, and the run reported negative NVMe bytes).
    assert full["nvme_read_bytes"] >= 0 and full["nvme_write_bytes"] >= 0, full
    assert full["lrs"] == pytest.approx(
        [LR * reference_factor("linear", s, 2, 5) for s in range(5)], rel=1e-9, abs=1e-15
    )
    # As if the run had stopped after saving step 2: later checkpoints gone, 'latest' naming step2.
    for tag in ("step4", "step5"):
        for root, dirs, files in os.walk(ck / tag, topdown=False):
            for f in files:
                os.remove(os.path.join(root, f))
            os.rmdir(root)
    (ck / "latest").write_text("step2")
    resumed, log = train("resumed.json")
    assert "--resume auto: the latest checkpoint" in log and "at step 2" in log
    assert resumed["first_step"] == 2 and len(resumed["step_s"]) == 3
    assert resumed["lrs"] == full["lrs"] and resumed["lr_final"] == full["lr_final"]
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-5, abs=0)
    assert [s for s, _ in resumed["eval_losses"]] == [2, 4, 5]
    assert [v for _, v in resumed["eval_losses"]] == pytest.approx([v for _, v in full["eval_losses"]], rel=1e-5, abs=0)


def test_keep_last_leaves_the_newest_checkpoints_and_a_resume_takes_the_latest(tmp_path):
    from helpers import aidaptiv_config

    config = aidaptiv_config(tmp_path, host_memory_budget="64MiB")
    args = ["--config", config, *COMMON, "--save-dir", str(tmp_path / "ck"), "--save-every", "1", "--keep-last", "2"]
    rc, log = run_train([*args, "--steps", "4", "--metrics-out", str(tmp_path / "m.json")], cwd=tmp_path)
    assert rc == 0, log[-3000:]
    tags = sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("step"))
    assert tags == ["step3", "step4"] and (tmp_path / "ck" / "latest").read_text().strip() == "step4"
    assert len(read_metrics(tmp_path / "m.json")["pruned"]) == 2
    rc, log = run_train([*args, "--steps", "5", "--resume", "auto"], cwd=tmp_path)
    assert rc == 0 and "at step 4" in log, log[-3000:]
    assert sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("step")) == ["step4", "step5"]
