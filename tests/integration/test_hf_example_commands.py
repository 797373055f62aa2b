"""The README's Hugging Face command, as written: `deepspeed examples/hf_trainer_finetune.py --deepspeed
ds_configs/aidaptiv.json --output_dir out --max_steps N` (the config's numbers, not "auto", against the Trainer's
defaults, which stopped it on Hugging Face's batch/lr mismatch check), then the same with
--resume_from_checkpoint, which the example used to ignore."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import CONFIGS, REPO, _free_port, child_env


def example(tmp_path, *args):
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [
        deepspeed,
        "--num_accelerators",
        "1",
        "--master_port",
        str(_free_port()),
        os.path.join(REPO, "examples", "hf_trainer_finetune.py"),
        "--deepspeed",
        os.path.join(CONFIGS, "aidaptiv.json"),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        *args,
    ]
    p = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    return p.returncode, p.stdout


def losses(out):
    return json.loads([x for x in out.splitlines() if "losses=" in x][-1].split("losses=")[1])


def test_the_readme_command_runs_and_resumes(tmp_path):
    rc, out = example(tmp_path, "--max_steps", "2", "--save_steps", "2")  # nvme_path "." is tmp_path
    assert rc == 0, out[-4000:]
    assert "aidaptiv swapper active" in out, out[-2000:]
    first = losses(out)
    assert len(first) == 2
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    rc, out = example(
        tmp_path,
        "--max_steps",
        "3",
        "--save_strategy",
        "no",
        "--resume_from_checkpoint",
        str(tmp_path / "out" / "checkpoint-2"),
    )
    assert rc == 0, out[-4000:]
    resumed = losses(out)
    # steps 1-2 come from the checkpoint's log history, step 3 is trained from the checkpoint's state
    assert len(resumed) == 3 and resumed[:2] == first, (first, resumed)
