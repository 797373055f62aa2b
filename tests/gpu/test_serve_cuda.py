"""`aidaptiv-ds serve --device cuda`: a request answered with the tokens `generate` gives on the GPU, and
concurrent requests batched (every row of a batch streamed from the GPU's steps). Skipped without CUDA; run on
a GPU machine (bench/gpu/device_check.sh runs tests/gpu)."""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_serve_on_cuda_answers_as_generate_and_batches(tmp_path):
    from test_serve import Served, _tiny_model

    from aidaptiv_ds.inference import Generator

    model = _tiny_model(tmp_path / "model")
    prompts = ["The swap space", "Pinned memory holds", "A layer group", "NVMe bandwidth"]
    with Generator(model, device="cuda") as gen:
        want = gen.generate(prompts[:1], max_new_tokens=8)[0].text
    served = Served(model, tmp_path, "--device", "cuda", "--served-model-name", "tiny", "--batch-wait-ms", "200")
    try:
        status, _, body = served.request(
            "POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 8, "temperature": 0}
        )
        assert status == 200 and json.loads(body)["choices"][0]["text"] == want

        def ask(p):
            return served.request("POST", "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})

        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(ask, prompts))
        assert all(s == 200 and json.loads(b)["choices"][0]["text"] for s, _, b in answers)
        assert json.loads(served.request("GET", "/health")[2])["largest_batch"] >= 2
    finally:
        served.stop()
