"""Models whose LM head is their input embedding (``tie_word_embeddings``: SmolLM2, Qwen2.5 up to 3B, Llama 3.2,
Gemma) train, save, resume and export through the aidaptiv block, fully and with LoRA/QLoRA adapters.

Built under zero.Init such a model first makes the head's own weight, which is partitioned into the swap space,
then ties the head to the embedding and drops that weight: its partition used to stay behind, belonging to no
parameter, and every save failed after the last step. The ``micro-tied`` preset is ``micro`` with a tied head."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, aidaptiv_config, child_env, read_metrics, run_train

COMMON = ["--model", "micro-tied", "--seq-len", "64", "--warmup", "0", "--no-progress"]


def _manifest(tag_dir):
    with open(os.path.join(tag_dir, "aidaptiv", "rank0", "manifest.json")) as f:
        return json.load(f)


def test_full_fine_tune_saves_resumes_and_exports_a_tied_model(tmp_path):
    from transformers import AutoModelForCausalLM

    config = aidaptiv_config(tmp_path, host_memory_budget="64MiB")
    full = [*COMMON, "--config", config, "--steps", "4", "--save-dir", str(tmp_path / "ck"), "--save-every", "2"]
    rc, log = run_train(
        [
            *full,
            "--output-dir",
            str(tmp_path / "out"),
            "--logits-out",
            str(tmp_path / "logits.pt"),
            "--metrics-out",
            str(tmp_path / "full.json"),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    manifest = _manifest(tmp_path / "ck" / "step2")
    names = [p["name"] for p in manifest["parameters"]]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    # The head's dropped weight left the swap space: the saved file holds the model's partitions and no more.
    assert manifest["params_bytes"] == sum(-(-p["partition_numel"] * 4 // 4096) * 4096 for p in manifest["parameters"])

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    trained = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        logits = model(input_ids=trained["input_ids"]).logits
    # the same weights; fp32 matmuls of two code paths may differ in the last bit (1e-6 absolute failed on a
    # Xeon VM at logits near 10: 1.19e-6, one ulp)
    torch.testing.assert_close(logits, trained["logits"], rtol=1.3e-6, atol=1e-6)

    rc, log = run_train(
        [
            *COMMON,
            "--config",
            config,
            "--steps",
            "4",
            "--save-dir",
            str(tmp_path / "ck2"),
            "--resume-from",
            str(tmp_path / "ck" / "step2"),
            "--metrics-out",
            str(tmp_path / "resumed.json"),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    first, resumed = read_metrics(tmp_path / "full.json"), read_metrics(tmp_path / "resumed.json")
    assert resumed["first_step"] == 2
    assert resumed["losses"] == pytest.approx(first["losses"], rel=1e-6, abs=0)


@pytest.mark.parametrize("spec", ["r=4", "r=4,bits=4"], ids=["lora", "qlora"])
def test_adapters_on_a_tied_base_save_and_export(tmp_path, spec):
    from transformers import AutoModelForCausalLM

    config = aidaptiv_config(tmp_path, host_memory_budget="64MiB")
    rc, log = run_train(
        [
            *COMMON,
            "--config",
            config,
            "--steps",
            "2",
            "--lora",
            spec,
            "--save-dir",
            str(tmp_path / "ck"),
            "--save-every",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    assert {"step1", "step2"} <= set(os.listdir(tmp_path / "ck"))
    assert os.path.isfile(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    if "bits=4" in spec:  # the adapter alone: a QLoRA base's packed 4-bit data are no HF weights
        assert not os.path.exists(tmp_path / "out" / "model.safetensors")
        return
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_run_that_fails_at_its_end_keeps_its_losses_in_the_metrics(tmp_path):
    """The final save fails (the file-size limit drops to 1 MiB just before it: a full disk for this job); the
    metrics still carry every step's loss, so the run's curve is not lost with its checkpoint."""
    config = aidaptiv_config(tmp_path, host_memory_budget="64MiB")
    cmd = [sys.executable, os.path.join(REPO, "tests", "faults", "fault_job.py"), "fsize-save", "1", "--"]
    args = [*COMMON, "--config", config, "--steps", "2", "--save-dir", str(tmp_path / "ck")]
    p = subprocess.run(
        [*cmd, *args, "--metrics-out", str(tmp_path / "m.json")],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert p.returncode == 1 and ("EFBIG" in p.stdout or "File too large" in p.stdout), p.stdout[-3000:]
    m = read_metrics(tmp_path / "m.json")
    assert m["status"] == "error" and len(m["losses"]) == 2 and all(math.isfinite(x) for x in m["losses"])
