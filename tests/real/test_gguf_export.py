"""`export --format gguf` of a fine-tuned real model (a LoRA run of SmolLM2-135M-Instruct, merged): transformers'
GGUF reader gives the safetensors export's weights back, bit for bit in bf16 (equal logits) and within q8_0's
rounding in q8_0 (logits within 5% of their largest magnitude, the same greedy answer; with
AIDAPTIV_TESTS_LONG=1), with the tokenizer and chat template (the same prompt ids)."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import aidaptiv_config, child_env, run_train

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def trained(real_folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    rc, log = run_train(
        ["--config", aidaptiv_config(tmp, host_memory_budget="512MiB"), "--model", real_folder, "--seq-len", "64",
         "--steps", "1", "--warmup", "0", "--no-progress", "--lr", "1e-4", "--lora", "r=4", "--dtype", "bf16",
         "--save-dir", str(tmp / "ck"), "--output-dir", str(tmp / "out")],
        cwd=tmp,
    )  # fmt: skip
    assert rc == 0, log[-3000:]
    return tmp


def _export(trained, kind):
    out = trained / f"model-{kind}.gguf"
    p = subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", "export", str(trained / "ck"), "--format", "gguf", "--gguf-type", kind,
         "--out", str(out)],
        capture_output=True, text=True, env=child_env(), timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert not [f for f in os.listdir(trained) if ".hf-" in f]  # the temporary folder is gone
    return out


def _logits_and_reply(folder, gguf_file=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        logits = model(**ids).logits
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    return ids["input_ids"], logits, tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize(
    "kind",
    ["bf16", pytest.param("q8_0", marks=pytest.mark.long("bench/gguf_llamacpp.py runs q8_0 in llama.cpp itself"))],
)
def test_the_gguf_reads_back_as_the_safetensors_export(trained, kind):
    gguf = _export(trained, kind)
    ids, logits, reply = _logits_and_reply(str(trained / "out"))
    ids2, logits2, reply2 = _logits_and_reply(str(gguf.parent), gguf.name)
    assert torch.equal(ids, ids2)  # the tokenizer and chat template came through
    if kind == "bf16":
        assert torch.equal(logits, logits2)
    else:
        assert (logits - logits2).abs().max() <= 0.05 * logits.abs().max()
    assert reply2 == reply
