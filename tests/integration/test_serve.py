"""`aidaptiv-ds serve`: the OpenAI HTTP API over a streamed model, spoken to by the `openai` client and by raw
HTTP: completions whole and streamed give the tokens `generate` gives, requests that arrive together share
batches, bad requests get the API's error shape, and only requests addressed to the server (with its key, when
it has one) are answered."""

import http.client
import json
import socket
import subprocess
import sys
import time

import pytest
from helpers import REPO, child_env

openai = pytest.importorskip("openai", reason="the openai client is a test dependency (requirements.txt)")


def _tiny_model(folder):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aidaptiv_ds.models.tokenizer import save_byte_tokenizer

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=300, bos_token_id=256, eos_token_id=257, pad_token_id=258)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights: replies that depend on the prompt
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(str(folder))
    save_byte_tokenizer(str(folder))
    return str(folder)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, model, tmp_path, *extra, env=None):
        self.port = _port()
        self.log = open(tmp_path / f"serve-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aidaptiv_ds", "serve", "--model", model, "--port", str(self.port), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=child_env(**(env or {})), cwd=REPO,
        )  # fmt: skip
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(open(self.log.name).read())
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.3)
        raise AssertionError("serve did not start:\n" + open(self.log.name).read())

    def request(self, method, path, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_completions_whole_streamed_and_batched_give_generates_tokens(tiny, tmp_path):
    from aidaptiv_ds.inference import Generator

    prompts = ["The swap space", "Pinned memory holds", "A layer group", "NVMe bandwidth"]
    with Generator(tiny, device="cpu") as gen:
        want = [r.text for r in gen.generate(prompts, max_new_tokens=8, batch_size=1)]
    served = Served(tiny, tmp_path, "--served-model-name", "tiny", "--batch-wait-ms", "200")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0)
        assert r.choices[0].text == want[0] and r.usage.completion_tokens == 8
        pieces = [c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompts[1], max_tokens=8, temperature=0, stream=True)]  # fmt: skip
        assert "".join(pieces) == want[1] and len([p for p in pieces if p]) > 1  # token by token
        # four clients at once: they share batches (the worker waits 200 ms for others to join)
        import concurrent.futures as cf

        def ask(p):
            return client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text

        with cf.ThreadPoolExecutor(4) as ex:
            replies = list(ex.map(ask, prompts))
        assert all(len(r) > 0 for r in replies)
        status, _, body = served.request("GET", "/health")
        stats = json.loads(body)
        assert status == 200 and stats["largest_batch"] >= 2, stats
    finally:
        served.stop()


def test_bad_requests_get_the_apis_error_shape_and_foreign_hosts_nothing(tiny, tmp_path):
    served = Served(tiny, tmp_path, "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused")
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=0)
        assert e.value.body["param"] == "max_tokens" and e.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="x")
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.completions.create(model="tiny", prompt="x", logprobs=2)
        status, _, body = served.request("POST", "/v1/completions", {"prompt": "x" * 10000, "max_tokens": 8})
        assert status == 400 and "context" in json.loads(body)["error"]["message"]
        # DNS rebinding: a page whose name resolves here sends its own Host and Origin
        rebound = {"Host": f"evil.example:{served.port}", "Origin": "http://evil.example"}
        status, headers, _ = served.request("POST", "/v1/completions", {"prompt": "x"}, rebound)
        assert status == 421 and not any(k.lower().startswith("access-control") for k in headers)
        # another site's page, even addressed to 127.0.0.1, is refused; no answer grants any origin
        status, headers, _ = served.request("GET", "/v1/models", None, {"Origin": "http://evil.example"})
        assert status == 403 and not any(k.lower().startswith("access-control") for k in headers)
        # loopback names on any port (an SSH tunnel's) and no Origin (the openai client, curl) are served
        for host in (f"localhost:{served.port + 1}", f"[::1]:{served.port}", "127.0.0.1"):
            assert served.request("GET", "/v1/models", None, {"Host": host})[0] == 200, host
        # a form post (what another site may send without a preflight) is refused
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
        conn.request("POST", "/v1/completions", body=b"prompt=x", headers={"Content-Type": "text/plain"})
        assert conn.getresponse().status == 415
    finally:
        served.stop()


def test_an_api_key_is_needed_off_loopback_and_checked(tiny, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", "serve", "--model", tiny, "--host", "0.0.0.0", "--port", str(_port())],
        capture_output=True, text=True, env=child_env(AIDAPTIV_SERVE_API_KEY=""), timeout=120,
    )  # fmt: skip
    assert p.returncode == 1 and "without an API key" in p.stderr
    served = Served(tiny, tmp_path, env={"AIDAPTIV_SERVE_API_KEY": "s3cret"})
    try:
        good = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="s3cret")
        assert good.models.list().data
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="wrong").models.list()
    finally:
        served.stop()
