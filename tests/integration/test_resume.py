"""Checkpoint at step k, resume, and compare steps k+1.. with the run that never stopped."""
import os

import pytest

from helpers import CONFIGS, read_metrics, run_train

STEPS, SAVE_AT = 5, 2
COMMON = ["--model", "micro", "--seq-len", "64", "--warmup", "0", "--no-progress"]


def train(cwd, config, *extra):
    metrics = cwd / f"m{len(list(cwd.glob('m*.json')))}.json"
    rc, log = run_train(["--config", os.path.join(CONFIGS, config), *COMMON, "--metrics-out", str(metrics), *extra],
                        cwd=cwd)
    assert rc == 0, log[-3000:]
    return read_metrics(metrics), log


def interrupted_and_resumed(tmp_path, config):
    """(uninterrupted losses, resumed losses): the first run saves every SAVE_AT steps on its way to STEPS;
    the second starts from the step-SAVE_AT tag, with a fresh swap folder, and trains on to STEPS."""
    full, _ = train(tmp_path, config, "--steps", str(STEPS), "--save-dir", str(tmp_path / "ck"),
                    "--save-every", str(SAVE_AT), "--nvme-path", str(tmp_path / "swap_a"))
    assert {"latest", f"step{SAVE_AT}", f"step{STEPS}"} <= set(os.listdir(tmp_path / "ck"))
    resumed, log = train(tmp_path, config, "--steps", str(STEPS), "--resume-from",
                         str(tmp_path / "ck" / f"step{SAVE_AT}"), "--nvme-path", str(tmp_path / "swap_b"))
    assert f"at step {SAVE_AT}" in log
    assert resumed["first_step"] == SAVE_AT and len(resumed["step_s"]) == STEPS - SAVE_AT
    assert len(resumed["losses"]) == STEPS
    # The losses before the checkpoint come back from its client state.
    assert resumed["losses"][:SAVE_AT] == full["losses"][:SAVE_AT]
    return full, resumed


def test_zero3_resume_continues_exactly(tmp_path):
    full, resumed = interrupted_and_resumed(tmp_path, "zero3.json")
    assert resumed["losses"][SAVE_AT:] == pytest.approx(full["losses"][SAVE_AT:], rel=1e-6, abs=0)
    assert resumed["lr_final"] == full["lr_final"]


def test_zero3_resume_from_latest_of_a_save_dir(tmp_path):
    train(tmp_path, "zero3.json", "--steps", str(SAVE_AT), "--save-dir", str(tmp_path / "ck"))
    resumed, log = train(tmp_path, "zero3.json", "--steps", str(SAVE_AT + 1), "--resume-from", str(tmp_path / "ck"))
    assert resumed["first_step"] == SAVE_AT and len(resumed["losses"]) == SAVE_AT + 1


@pytest.mark.slow
def test_zero_infinity_resume_diverges_in_deepspeed_0_19_8(tmp_path):
    """Recorded behaviour, not a wish: DeepSpeed 0.19.8 restores ZeRO-Infinity's weights (the first step after
    the resume gives the uninterrupted loss) but not its NVMe optimizer state, so later losses drift. If this
    test starts failing because the losses agree, DeepSpeed was fixed: update ds_configs/README.md."""
    full, resumed = interrupted_and_resumed(tmp_path, "zero_infinity.json")
    assert resumed["losses"][SAVE_AT] == pytest.approx(full["losses"][SAVE_AT], rel=1e-6)
    later_full, later_resumed = full["losses"][SAVE_AT + 1:], resumed["losses"][SAVE_AT + 1:]
    assert later_resumed != pytest.approx(later_full, rel=1e-6), "resume now matches: DeepSpeed fixed it?"
