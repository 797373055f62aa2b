"""Mixtures of experts on CUDA: `generate` of an MoE model larger than the GPU budget gives the in-memory CUDA
model's greedy tokens (on CUDA the experts stream with their layers, as `generate` says: routed experts are read
on CPU only for now), and the micro-moe preset trains through the aidaptiv block on the GPU with stock ZeRO-3's
losses (load-balancing loss included). Skipped without CUDA; run on a GPU machine (bench/gpu/device_check.sh
runs tests/gpu)."""

import os
import sys

import pytest
import torch
from helpers import CONFIGS, aidaptiv_config, assert_same_losses, read_metrics, run_train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("family,budget", [("olmoe", "2.5MiB"), ("gpt_oss", "700KiB")])
def test_moe_generation_on_cuda_gives_the_in_memory_tokens(tmp_path, family, budget):
    from test_generate_moe import NEW, PROMPTS, _save

    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.models.tokenizer import HFTokenizer

    folder = _save(tmp_path / family, family)
    (tmp_path / "nvme").mkdir()  # generate takes an existing swap folder only
    with Generator(folder, host_budget=budget, nvme_path=str(tmp_path / "nvme"), device="cuda") as gen:
        got = [r.token_ids for r in gen.generate(PROMPTS, max_new_tokens=NEW, batch_size=1)]
        ex = gen.stats()["experts"]
    assert ex["mode"] == "whole" and "routed experts are read on CPU only" in ex["note"], ex
    from transformers import AutoModelForCausalLM

    tok = HFTokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    for prompt, ids in zip(PROMPTS, got):
        x = torch.tensor([tok.encode(prompt, add_bos=True, add_eos=False)], device="cuda")
        with torch.no_grad():
            out = model.generate(input_ids=x, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
        ref = out[0, x.shape[1] :].tolist()
        if tok.eos_token_id in ref:
            ref = ref[: ref.index(tok.eos_token_id) + 1]
        assert ids == ref, (family, prompt)


def test_micro_moe_trains_through_the_block_on_cuda_with_stock_zero3s_losses(tmp_path):
    common = ["--model", "micro-moe", "--seq-len", "64", "--steps", "3", "--warmup", "1", "--no-progress"]
    runs = {}
    for name, config in (
        ("ours", aidaptiv_config(tmp_path, host_memory_budget="40MiB", layer_group_size=1)),
        ("ref", os.path.join(CONFIGS, "zero3.json")),
    ):
        out = tmp_path / f"{name}.json"
        rc, log = run_train(["--config", config, *common, "--metrics-out", str(out)], cwd=tmp_path)
        assert rc == 0, log[-3000:]
        runs[name] = read_metrics(out)
    ours, ref = runs["ours"], runs["ref"]
    assert ours["device"] == "cuda" and ours["backend"] == "aidaptiv", ours
    assert ours["moe"]["leaf_blocks"] == 2 and len(ours["aux_losses"]) == 3
    assert_same_losses(ours["losses"], ref["losses"], rel=1e-5)
    assert_same_losses(ours["aux_losses"], ref["aux_losses"], rel=1e-5)
