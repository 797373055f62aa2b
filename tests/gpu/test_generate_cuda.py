"""`aidaptiv-ds generate` on CUDA: layers resident on the GPU within its budget, copied from pinned host memory
or streamed from the swap space through pinned slots and their GPU twins give the in-memory CUDA model's greedy
tokens, in fp32 and bf16. Skipped without CUDA; run on a GPU machine
(bench/gpu/device_check.sh runs tests/gpu)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# (dtype, host budget, GPU budget, the tiers that must hold layers). Layers are about 0.96 MiB in fp32, 0.48 in
# bf16; the GPU budget holds the head and final norm and two twins before any resident layer, the host budget
# two pinned slots and the row buffer before any layer kept in host memory.
CASES = [
    ("float32", "2.5MiB", "2.5MiB", {"swap"}),
    ("bfloat16", "1.5MiB", "1.5MiB", {"host", "swap"}),
    ("float32", "3.5MiB", "4MiB", {"gpu", "host", "swap"}),
    ("bfloat16", "64MiB", "1.5MiB", {"host"}),
]


@pytest.mark.parametrize("dtype,host,gpu,tiers", CASES)
def test_streamed_on_cuda_gives_the_in_memory_tokens(tmp_path, dtype, host, gpu, tiers):
    from test_generate import PROMPTS, _save_model
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.models.tokenizer import HFTokenizer

    folder = _save_model(tmp_path / "model")
    (tmp_path / "nvme").mkdir()  # generate takes an existing swap folder only
    kw = dict(host_budget=host, gpu_budget=gpu, nvme_path=str(tmp_path / "nvme"), device="cuda", dtype=dtype)
    with Generator(folder, **kw) as g:
        st = g.stats()
        layers = [x for x in g.weights.groups if x.is_layer]
        held = {
            "gpu": any(x.resident for x in layers),
            "host": st["in_host_bytes_per_pass"] > 0,
            "swap": st["streamed_bytes_per_pass"] > 0,
        }
        assert {k for k, v in held.items() if v} == tiers, st
        got = g.generate(PROMPTS[:1], max_new_tokens=12)[0].token_ids
        assert g.stats()["bytes_read"] >= 11 * st["streamed_bytes_per_pass"]
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
