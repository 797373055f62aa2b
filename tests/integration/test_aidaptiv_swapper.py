"""Our swapper run the way users run it, in child processes: loss parity with in-memory ZeRO-3 on one and
two ranks, a run killed after a checkpoint and resumed, an I/O failure in the middle of a run, HF Trainer
with --deepspeed, and a plain deepspeed.initialize script.

The host budget (40 MiB) is well below the micro preset's model state (4.7M parameters, 94 MiB), so
parameters and optimizer state really move through the swap files every step.
"""

import glob
import json
import os
import resource
import subprocess
import sys
import time

import helpers
import pytest
from helpers import (
    CONFIGS,
    REPO,
    _free_port,
    assert_same_losses,
    child_env,
    failure_excerpt,
    read_metrics,
    run_train,
)

from aidaptiv_ds.zero3 import dist_shm
from aidaptiv_ds.zero3.compat import SHM_ALLREDUCE_PREFIX

BUDGET = "40MiB"
STEPS = 4
COMMON = ["--model", "micro", "--seq-len", "64", "--micro-batch", "2", "--warmup", "1"]


def aidaptiv_config(tmp_path, **block):
    """ds_configs/aidaptiv.json with its swap space in tmp_path and the small budget."""
    return helpers.aidaptiv_config(tmp_path, **{"host_memory_budget": BUDGET, "layer_group_size": 1, **block})


def train(tmp_path, config, name, *extra, procs=None, steps=STEPS):
    out = tmp_path / f"{name}.json"
    rc, log = run_train(
        ["--config", config, *COMMON, "--steps", str(steps), "--metrics-out", str(out), *extra],
        cwd=tmp_path,
        launcher_procs=procs,
    )
    assert rc == 0, failure_excerpt(log)
    return read_metrics(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """In-memory ZeRO-3 on the same model, data and seed."""
    tmp = tmp_path_factory.mktemp("zero3")
    return train(tmp, os.path.join(CONFIGS, "zero3.json"), "zero3", steps=6)


def test_losses_match_zero3_and_state_really_moves_through_nvme(tmp_path, reference):
    m = train(tmp_path, aidaptiv_config(tmp_path), "aidaptiv", steps=6)
    assert m["backend"] == "aidaptiv"
    assert_same_losses(m["losses"], reference["losses"])
    # Every timed step reads parameters and optimizer state from the disk (the budget cannot hold them).
    timed = m["nvme_bytes_steps"]
    param_bytes = m["params"] * 4
    assert m["nvme_read_bytes"] / timed > param_bytes, m["nvme_read_bytes"]
    assert m["nvme_write_bytes"] / timed > param_bytes, m["nvme_write_bytes"]
    assert 0 < m["peak_pinned_mb"] <= 40.0 + 1e-6
    assert m["phases_s"]["io_wait"] is not None and m["phases_s"]["io_wait"] >= 0
    # The swap files are gone after the run.
    assert os.listdir(tmp_path / "swap") == []


def test_two_ranks_match_zero3_two_ranks(tmp_path):
    ref = train(tmp_path, os.path.join(CONFIGS, "zero3.json"), "zero3", procs=2, steps=3)
    m = train(tmp_path, aidaptiv_config(tmp_path), "aidaptiv", procs=2, steps=3)
    assert m["world_size"] == 2
    assert_same_losses(m["losses"], ref["losses"])
    assert os.listdir(tmp_path / "swap") == []  # each rank removed its own swap folder


def _wait_for_latest(save_dir, tag, proc, timeout=600):
    latest = os.path.join(save_dir, "latest")
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(latest) and open(latest).read().strip() == tag:
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"training exited ({proc.returncode}) before checkpoint {tag}: " + proc.stdout.read()[-3000:]
            )
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint {tag} after {timeout}s")


def _start(tmp_path, config, *extra):
    cmd = [sys.executable, "-m", "aidaptiv_ds", "train", "--config", config, *COMMON, *extra]
    return subprocess.Popen(
        cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_killed_run_resumes_the_uninterrupted_trajectory(tmp_path, reference):
    config = aidaptiv_config(tmp_path)
    save = str(tmp_path / "ckpt")
    proc = _start(tmp_path, config, "--steps", "6", "--save-dir", save, "--save-every", "3", "--no-progress")
    _wait_for_latest(save, "step3", proc)
    proc.kill()  # SIGKILL: no clean-up at all; its swap files stay behind
    proc.wait()
    m = train(tmp_path, config, "resumed", "--resume-from", save, steps=6)
    assert m["first_step"] == 3
    # Steps 4-6 of the resumed run are the uninterrupted run's steps 4-6.
    assert_same_losses(m["losses"][-3:], reference["losses"][3:6], rel=1e-6)


def test_io_failure_mid_run_is_a_clear_error_and_the_last_checkpoint_resumes(tmp_path, reference):
    config = aidaptiv_config(tmp_path)
    save = str(tmp_path / "ckpt")
    proc = _start(tmp_path, config, "--steps", "6", "--save-dir", save, "--save-every", "2", "--no-progress")
    _wait_for_latest(save, "step2", proc)
    # From now on no file of this process may grow past 1 MiB: the next swap write or checkpoint file
    # beyond that fails with EFBIG (as a full disk fails with ENOSPC).
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out[-3000:]
    last = [line for line in out.splitlines() if line.startswith("aidaptiv-ds train: status=")][-1]
    assert "status=error" in last and "File too large" in last, last
    assert ".swp" in last or ".bin" in last or "offset" in last, last  # names the file/offset
    tag = open(os.path.join(save, "latest")).read().strip()
    assert tag in ("step2", "step4")
    m = train(tmp_path, config, "resumed", "--resume-from", save, steps=6)
    done = int(tag[len("step") :])
    assert_same_losses(m["losses"][-(6 - done) :], reference["losses"][done:6], rel=1e-6)


def test_hf_trainer_with_deepspeed_flag_uses_the_swapper(tmp_path):
    config = aidaptiv_config(tmp_path)
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [
        deepspeed,
        "--num_accelerators",
        "1",
        "--master_port",
        str(_free_port()),
        os.path.join(REPO, "examples", "hf_trainer_finetune.py"),
        "--deepspeed",
        config,
        "--output_dir",
        str(tmp_path / "out"),
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "7e-6",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
    ]
    before = set(glob.glob(os.path.join(dist_shm.SHM_DIR, SHM_ALLREDUCE_PREFIX + "_*")))
    p = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert p.returncode == 0, p.stdout[-4000:]
    # One process under the launcher still gets DeepSpeed's 66 MiB /dev/shm segment; it must not outlive the run.
    assert set(glob.glob(os.path.join(dist_shm.SHM_DIR, SHM_ALLREDUCE_PREFIX + "_*"))) - before == set()
    line = [x for x in p.stdout.splitlines() if "aidaptiv swapper" in x][-1]
    assert "aidaptiv swapper active" in line and int(line.split("nvme_read_bytes=")[1]) > 0, line
    losses = json.loads([x for x in p.stdout.splitlines() if "losses=" in x][-1].split("losses=")[1])
    assert len(losses) == 3


PLAIN_SCRIPT = """
import json, os, sys, torch, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
cfg = json.load(open(sys.argv[1]))
deepspeed.init_distributed("gloo")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=1000))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
ids = torch.randint(0, 1000, (2, 32))
loss = engine(input_ids=ids, labels=ids).loss
engine.backward(loss)
engine.step()
print("SWAPPER", hasattr(engine, "aidaptiv_stats"))
engine.destroy()
"""


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_plain_deepspeed_script_picks_up_the_block(tmp_path, autoload):
    config = aidaptiv_config(tmp_path)
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    env = child_env(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        AIDAPTIV_DS_AUTOLOAD=autoload,
    )
    p = subprocess.run(
        [sys.executable, str(script), config],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    # With the hook the block turns the swapper on; switched off, DeepSpeed runs the config as it is.
    assert f"SWAPPER {autoload == '1'}" in p.stdout


@pytest.mark.parametrize(
    "extra,reference_config,rel",
    [
        # bf16: separate fp32 masters in the optimizer chunks, updated values converted into the parameters.
        (("--dtype", "bf16"), "zero3_cpu_offload.json", 1e-5),
        # Gradient accumulation: gradient buffers carried (and written out under pressure) across micro-steps.
        pytest.param(
            ("--grad-accum", "3"),
            "zero3.json",
            1e-5,
            marks=pytest.mark.long("accumulation with the deferred update: test_deferred_update.py"),
        ),
    ],
    ids=["bf16", "grad-accum"],
)
def test_other_paths_match_deepspeed(tmp_path, extra, reference_config, rel):
    ref = train(tmp_path, os.path.join(CONFIGS, reference_config), "ref", *extra, steps=4)
    m = train(tmp_path, aidaptiv_config(tmp_path), "aidaptiv", *extra, steps=4)
    assert_same_losses(m["losses"], ref["losses"], rel=rel)
    assert m["nvme_read_bytes"] > 0
