"""The fine-tuned real model through `aidaptiv-ds serve` to the openai client: chat and completion, plain and
streamed, with the tokens `generate` gives for the same conversation."""

import os
import sys

import pytest
from helpers import REPO

openai = pytest.importorskip("openai", reason="the openai client is a test dependency (requirements.txt)")
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
from test_serve import Served  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_plain_and_streamed_as_generate_gives(real_folder, tmp_path):
    from aidaptiv_ds.inference import Generator

    with Generator(real_folder, device="cpu") as gen:
        want = gen.generate([QUESTION], max_new_tokens=24)[0].text
    assert want == "The capital of France is Paris."
    served = Served(real_folder, tmp_path, "--served-model-name", "smollm2")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused")
        r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        # a stop string ends the reply where it appears, as the API says
        cut = client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=24, temperature=0, stop=[" is"]
        )
        assert cut.choices[0].message.content == "The capital of France" and cut.choices[0].finish_reason == "stop"
    finally:
        served.stop()
