"""A checkpoint is data, not code, and a damaged one does not resume as a success: a pickle payload planted in
DeepSpeed's model_states.pt is refused before it runs, a truncated model_states.pt is one clear sentence."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import CONFIGS, read_metrics, run_train

COMMON = ["--model", "micro", "--seq-len", "64", "--warmup", "0", "--no-progress"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-step aidaptiv run of the micro preset saved at step 2 (tag step2)."""
    root = tmp_path_factory.mktemp("trust")
    (root / "swap").mkdir()
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "aidaptiv.json"),
            *COMMON,
            "--steps",
            "2",
            "--save-dir",
            str(root / "ck"),
            "--nvme-path",
            str(root / "swap"),
        ],
        cwd=root,
    )
    assert rc == 0, log[-3000:]
    return root


def resume(root, name):
    """Resume the saved run to step 3 with a copy of the checkpoint; (rc, log, metrics or None)."""
    metrics = root / f"{name}.json"
    (root / f"swap_{name}").mkdir()
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "aidaptiv.json"),
            *COMMON,
            "--steps",
            "3",
            "--resume-from",
            str(root / f"ck_{name}" / "step2"),
            "--nvme-path",
            str(root / f"swap_{name}"),
            "--metrics-out",
            str(metrics),
        ],
        cwd=root,
    )
    return rc, log, read_metrics(metrics) if metrics.exists() else None


def copy_checkpoint(root, name):
    import shutil

    shutil.copytree(root / "ck", root / f"ck_{name}")
    return root / f"ck_{name}" / "step2"


class Payload:
    """Unpickling this runs exec(): what a planted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('the payload ran')",))


def test_a_payload_planted_in_model_states_does_not_run(saved):
    tag = copy_checkpoint(saved, "planted")
    states = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    marker = saved / "payload_ran"
    sd = torch.load(states, weights_only=False)  # we wrote it: trusted here
    sd["client_state_extra"] = Payload(marker)
    torch.save(sd, states)
    rc, log, metrics = resume(saved, "planted")
    assert not marker.exists(), "the planted payload ran"
    assert rc == 1, log[-3000:]
    assert "holds objects other than tensors and plain data" in log and str(states) in log, log[-3000:]
    assert metrics is not None and metrics["status"] == "error"


def test_a_truncated_model_states_is_one_clear_sentence(saved):
    tag = copy_checkpoint(saved, "truncated")
    states = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with open(states, "r+b") as f:
        f.truncate(os.path.getsize(states) // 2)
    rc, log, _ = resume(saved, "truncated")
    assert rc == 1, log[-3000:]
    assert f"checkpoint file {states} cannot be read" in log and "truncated or damaged" in log, log[-3000:]


def test_an_untouched_checkpoint_still_resumes(saved):
    copy_checkpoint(saved, "clean")
    rc, log, metrics = resume(saved, "clean")
    assert rc == 0, log[-3000:]
    assert metrics["first_step"] == 2 and len(metrics["losses"]) == 3
