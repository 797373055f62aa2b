"""`aidaptiv-ds generate` on CUDA: layers streamed from the swap space through pinned slots and their GPU twins
give the in-memory CUDA model's greedy tokens, in fp32 and bf16. Skipped without CUDA; run on a GPU machine
(bench/gpu/device_check.sh runs tests/gpu)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_on_cuda_gives_the_in_memory_tokens(tmp_path, dtype):
    from test_generate import PROMPTS, _save_model
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.models.tokenizer import HFTokenizer

    folder = _save_model(tmp_path / "model")
    budget = "2.5MiB" if dtype == "float32" else "1.5MiB"
    with Generator(folder, host_budget=budget, nvme_path=str(tmp_path / "nvme"), device="cuda", dtype=dtype) as g:
        assert g.stats()["streamed_bytes_per_pass"] > 0
        got = g.generate(PROMPTS[:1], max_new_tokens=12)[0].token_ids
    tok = HFTokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).cuda().eval()
    ids = torch.tensor([tok.encode(PROMPTS[0], add_bos=True, add_eos=False)], device="cuda")
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
        )
    want = out[0, ids.shape[1] :].tolist()
    if tok.eos_token_id in want:
        want = want[: want.index(tok.eos_token_id) + 1]
    assert got == want
