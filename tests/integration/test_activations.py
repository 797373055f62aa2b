"""Activation policies (aidaptiv.activations) and the chunked loss, run the way users run them: our train job
and a plain deepspeed.initialize script with a model built under zero.Init. The losses equal in-memory
ZeRO-3's unchunked ones (fp32: 1e-5 relative), the nvme policy really moves the checkpointed activations
through the swap space, and the metrics say what was done.

The micro preset (2 blocks, hidden 256) at micro-batch 2 x 64 tokens: each block input is 128 KiB; the loss
runs in chunks of 16 tokens (8 chunks).
"""

import json
import os
import subprocess
import sys

import helpers
import pytest
from helpers import (
    CONFIGS,
    _free_port,
    assert_same_losses,
    child_env,
    failure_excerpt,
    read_metrics,
    run_train,
)

BUDGET = "40MiB"
STEPS = 4
COMMON = ["--model", "micro", "--seq-len", "64", "--micro-batch", "2", "--warmup", "1"]
CHUNK = 16


def aidaptiv_config(tmp_path, **activations):
    return helpers.aidaptiv_config(tmp_path, host_memory_budget=BUDGET, layer_group_size=1, activations=activations)


def train(tmp_path, config, name, *extra, procs=None):
    out = tmp_path / f"{name}.json"
    rc, log = run_train(
        ["--config", config, *COMMON, "--steps", str(STEPS), "--metrics-out", str(out), *extra],
        cwd=tmp_path,
        launcher_procs=procs,
    )
    assert rc == 0, failure_excerpt(log)
    return read_metrics(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """In-memory ZeRO-3, the model's own unchunked loss, activations kept."""
    tmp = tmp_path_factory.mktemp("zero3")
    return train(tmp, os.path.join(CONFIGS, "zero3.json"), "zero3")


@pytest.mark.parametrize("policy", ["keep", "recompute", "nvme"])
def test_each_policy_with_the_chunked_loss_matches_zero3(tmp_path, reference, policy):
    m = train(tmp_path, aidaptiv_config(tmp_path, policy=policy, loss_chunk_tokens=CHUNK), policy)
    assert_same_losses(m["losses"], reference["losses"])
    a = m["activations"]
    assert a["policy"] == policy and a["loss_chunk_tokens"] == CHUNK
    # The saving of the chunked loss: 128 tokens x 2048 vocabulary of fp32 logits and gradient, 16 at a time.
    assert m["loss_logits_mb"] == {"unchunked": 2 * 128 * 2048 * 4 / 2**20, "chunked": 2 * 16 * 2048 * 4 / 2**20}
    assert (a["recompute"] is not None) == (policy != "keep")
    if policy == "nvme":
        # Both block inputs of every micro-step went to the disk and came back.
        assert a["tensors_stored"] >= 2 * STEPS and a["bytes_stored"] >= 2 * STEPS * 2 * 64 * 256 * 4
        assert a["bytes_read"] >= a["bytes_stored"] and a["cycles"] == STEPS
        assert m["phases_s"]["activation_io_wait"] is not None
    else:
        assert "bytes_stored" not in a
    assert os.listdir(tmp_path / "swap") == []  # the activation file went with the rest


def test_bf16_nvme_policy_is_as_close_as_the_chunked_sums_allow(tmp_path):
    # Recompute and storage change no bit in bf16 (measured: equal losses with loss_chunk_tokens 0); with
    # several chunks the loss and the head's weight gradient are summed in another order, which moves a few
    # bf16 roundings of the updated weights: measured 4.7e-6 relative after 4 steps (first step: 6e-8) on an AMD
    # EPYC, 2.7e-5 on a Xeon with AMX-BF16, whose oneDNN kernels round bf16 products differently.
    ref = train(tmp_path, os.path.join(CONFIGS, "zero3_cpu_offload.json"), "bf16-ref", "--dtype", "bf16")
    m = train(
        tmp_path, aidaptiv_config(tmp_path, policy="nvme", loss_chunk_tokens=CHUNK), "bf16-nvme", "--dtype", "bf16"
    )
    assert abs(m["losses"][0] - ref["losses"][0]) <= 1e-6 * abs(ref["losses"][0])
    assert_same_losses(m["losses"], ref["losses"], rel=5e-5)
    assert m["activations"]["bytes_stored"] >= 2 * STEPS * 2 * 64 * 256 * 2


def test_nvme_and_auto_policies_on_two_ranks_match_zero3_two_ranks(tmp_path, monkeypatch):
    ref = train(tmp_path, os.path.join(CONFIGS, "zero3.json"), "zero3-2", procs=2)
    m = train(tmp_path, aidaptiv_config(tmp_path, policy="nvme", loss_chunk_tokens=CHUNK), "nvme-2", procs=2)
    assert_same_losses(m["losses"], ref["losses"])
    assert m["activations"]["bytes_stored"] > 0
    # auto with no budget: nothing can be kept and no recomputed input fits, so both blocks are stored on
    # every rank (rank 0's plan); no rates cache, so the plan measured the disk through the engine.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-cache"))
    monkeypatch.delenv("AIDAPTIV_DS_CACHE_DIR", raising=False)  # the suite-wide cache (conftest) would win
    m = train(tmp_path, aidaptiv_config(tmp_path, policy="auto", loss_chunk_tokens=CHUNK, budget=0), "auto-2", procs=2)
    assert_same_losses(m["losses"], ref["losses"])
    a = m["activations"]
    assert a["plan"]["stored_blocks"] == [0, 1] and a["plan"]["budget_source"] == "activations.budget"
    assert a["plan"]["nvme_bandwidth_source"].startswith("measured now") and a["plan"]["nvme_read_bps"] > 0
    # Stored from the second step on (the first measures), every block's saved tensors, and read back.
    assert a["cycles"] == STEPS - 1 and a["bytes_read"] >= a["bytes_stored"]
    assert a["bytes_stored"] >= (STEPS - 1) * sum(b["stored_bytes"] for b in a["plan"]["blocks"])
    assert len(a["io_wait_s_cycles"]) == STEPS and m["phases_s"]["activation_io_wait"] is not None


PLAIN_SCRIPT = """
import json, sys, torch, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
cfg = json.load(open(sys.argv[1]))
deepspeed.init_distributed("gloo")
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=cfg):
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                         num_attention_heads=4, vocab_size=1000))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
losses = []
for step in range(3):
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(step))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print("LOSSES", json.dumps(losses))
print("ACTIVATIONS", json.dumps(engine.aidaptiv_stats().get("activations")))
engine.destroy()
"""


def run_plain(tmp_path, name, **activations):
    sub = tmp_path / name
    sub.mkdir()
    config = aidaptiv_config(sub, **activations)
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    env = child_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    p = subprocess.run(
        [sys.executable, str(script), config],
        cwd=sub,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    lines = {
        ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1])
        for ln in p.stdout.splitlines()
        if ln.startswith(("LOSSES ", "ACTIVATIONS "))
    }
    return lines["LOSSES"], lines["ACTIVATIONS"]


def test_plain_deepspeed_script_under_zero_init_gets_the_policy(tmp_path):
    keep, _ = run_plain(tmp_path, "keep", policy="keep", loss_chunk_tokens=0)
    nvme, stats = run_plain(tmp_path, "nvme", policy="nvme", loss_chunk_tokens=32)
    assert_same_losses(nvme, keep)
    assert stats["policy"] == "nvme" and stats["loss_chunk_tokens"] == 32
    assert stats["tensors_stored"] >= 3 * 3 and stats["bytes_read"] >= stats["bytes_stored"] > 0


SLOW_DISK = 1000.0  # bytes/s given as the disk's bandwidth: storing a block never beats recomputing it


@pytest.mark.long("the auto policy on two ranks above; its modes per block: tests/io/test_activation_auto.py")
def test_auto_policy_mixing_every_mode_matches_keep(tmp_path):
    keep, _ = run_plain(tmp_path, "keep", policy="keep", loss_chunk_tokens=0)
    # A budget with room for everything keeps all three blocks, and reports what each one measured.
    everything, first = run_plain(
        tmp_path, "all", policy="auto", loss_chunk_tokens=0, budget=1 << 40, nvme_bandwidth=SLOW_DISK
    )
    assert_same_losses(everything, keep)
    assert first["plan"]["kept_blocks"] == [0, 1, 2] and first["bytes_stored"] == 0
    # The blocks have one shape: room for one kept block, one recomputed input and one stored block's rest.
    b = first["plan"]["blocks"][-1]
    assert b["input_bytes"] == 2 * 128 * 128 * 4 and b["saved_bytes"] > b["stored_bytes"] // 2 > b["input_bytes"]
    budget = b["saved_bytes"] + b["input_bytes"] + b["left_bytes"]
    mixed, stats = run_plain(
        tmp_path, "mixed", policy="auto", loss_chunk_tokens=0, budget=budget, nvme_bandwidth=SLOW_DISK
    )
    assert_same_losses(mixed, keep)
    plan = stats["plan"]
    assert [x["mode"] for x in plan["blocks"]] == ["nvme", "recompute", "keep"], plan
    assert plan["held_bytes"] <= budget and plan["recomputed_layers"] == [1]
    # Block 0's saved tensors went to the disk in steps 2 and 3 (step 1 measured) and came back.
    assert stats["cycles"] == 2 and stats["bytes_stored"] == 2 * plan["blocks"][0]["stored_bytes"]
    assert stats["bytes_read"] >= stats["bytes_stored"]


def run_hf_trainer(tmp_path, name, **activations):
    from helpers import REPO

    sub = tmp_path / name
    sub.mkdir()
    config = aidaptiv_config(sub, **activations)
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
        str(sub / "out"),
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
    p = subprocess.run(
        cmd, cwd=sub, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert p.returncode == 0, p.stdout[-4000:]
    losses = json.loads([x for x in p.stdout.splitlines() if "losses=" in x][-1].split("losses=")[1])
    stats = [x for x in p.stdout.splitlines() if x.startswith("activations=")]
    return losses, json.loads(stats[-1].split("=", 1)[1]) if stats else None


@pytest.mark.long(
    "the same config's policy in a plain script: above; the HF Trainer's swapper path: test_aidaptiv_swapper.py"
)
def test_hf_trainer_gets_the_policy_from_the_deepspeed_config(tmp_path):
    keep, _ = run_hf_trainer(tmp_path, "keep", policy="keep", loss_chunk_tokens=0)
    nvme, stats = run_hf_trainer(tmp_path, "nvme", policy="nvme", loss_chunk_tokens=CHUNK)
    assert len(nvme) == 3 and nvme == pytest.approx(keep, rel=1e-4)  # the Trainer logs 4 significant digits
    assert stats["policy"] == "nvme" and stats["loss_chunk_tokens"] == CHUNK
    assert stats["recompute"] and stats["bytes_read"] >= stats["bytes_stored"] > 0
