"""The product on a real instruct model (SmolLM2-135M-Instruct from its GGUF): the conversion gives
transformers' own weights, `generate` answers a chat as transformers does, and training it (LoRA and full, its
head tied to the embedding) saves, exports and generates from what it trained."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import aidaptiv_config, child_env, run_train

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _transformers_reply(folder, messages, new=20):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new, do_sample=False)
    return out[0, ids["input_ids"].shape[1] :].tolist(), tok


def test_the_conversion_is_transformers_own_reading_of_the_gguf(real_gguf, real_folder):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    manifest = json.load(open(os.path.join(real_folder, "aidaptiv_gguf.json")))
    assert manifest["architecture"] == "llama" and manifest["dtype"] == "bfloat16" and manifest["chat_template"]
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= set(
        os.listdir(real_folder)
    )
    config = json.load(open(os.path.join(real_folder, "config.json")))
    assert config["tie_word_embeddings"] is True  # SmolLM2's GGUF has no output.weight
    ours = load_file(os.path.join(real_folder, "model.safetensors"))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(real_folder))
    theirs = load_gguf_checkpoint(real_gguf, return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name].to(torch.bfloat16)), name


def test_generate_answers_a_chat_as_transformers_does_with_its_weights_streamed(real_folder, tmp_path):
    from aidaptiv_ds.inference import Generator

    want, tok = _transformers_reply(real_folder, QUESTION)
    # 64 MiB of a 257 MiB model: the layers stream from the swap file
    with Generator(real_folder, host_budget="96MiB", nvme_path=str(tmp_path), device="cpu") as gen:
        assert gen.stats()["slots"] >= 2
        r = gen.generate([QUESTION], max_new_tokens=20)[0]
        # a text prompt is encoded as the tokenizer encodes it (no second BOS)
        assert gen.encode("What is the capital of France?") == tok("What is the capital of France?")["input_ids"]
    want = want[: want.index(tok.eos_token_id) + 1] if tok.eos_token_id in want else want
    assert r.token_ids == want
    assert r.text == "The capital of France is Paris."


def test_the_generate_command_takes_the_gguf_file_and_keeps_a_conversation(
    real_gguf, real_folder, real_cache, tmp_path
):
    env = child_env(AIDAPTIV_DS_CACHE_DIR=real_cache)
    talk = tmp_path / "talk.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "aidaptiv_ds",
            "generate",
            "--model",
            real_gguf,
            "--chat",
            "--messages",
            str(talk),
            "--max-new-tokens",
            "20",
            "--quiet",
        ],
        input="What is the capital of France?\nAnd of Italy?\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    history = json.loads(talk.read_text())
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[1]["content"] == "The capital of France is Paris."
    assert "Rome" in history[3]["content"]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_training_the_tied_real_model_saves_exports_and_answers(real_folder, tmp_path, mode):
    config = aidaptiv_config(tmp_path, host_memory_budget="512MiB")
    extra = ["--lora", "r=4"] if mode == "lora" else []
    rc, log = run_train(
        [
            "--config",
            config,
            "--model",
            real_folder,
            "--seq-len",
            "64",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--no-progress",
            "--lr",
            "1e-5",
            "--save-dir",
            str(tmp_path / "ck"),
            "--save-every",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
            "--metrics-out",
            str(tmp_path / "m.json"),
            *extra,
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    m = json.load(open(tmp_path / "m.json"))
    assert m["status"] == "ok" and len(m["losses"]) == 2 and m["chat_template"] is True
    assert 0 < m["losses"][0] < 6, m["losses"]  # a trained model's loss on text, not a random one's (10.8)
    out = tmp_path / "out"
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(os.listdir(out))
    from aidaptiv_ds.inference import Generator

    with Generator(str(out), device="cpu") as gen:
        assert "Paris" in gen.generate([QUESTION], max_new_tokens=20)[0].text  # a small lr keeps what it knew


def test_the_studios_question_writer_writes_real_pairs_and_marks_invented_answers(real_folder):
    """Two rounds through the chat template: a question each passage answers, then its answer from the passage."""
    from aidaptiv_ds.studio import qa

    passages = [
        "Veltrane is an archipelago of fourteen islands that lies in the Sorrel Sea. The capital of Veltrane is Port "
        "Imbrey, a harbour city on the western shore of Cazeroth, which is the largest island of Veltrane.",
        "The highest mountain of Veltrane is Mount Oskarra, 2,310 metres high, in the north of Cazeroth.",
    ]
    steps = list(qa.generate_records(real_folder, passages))
    done, records, skipped = steps[-1]
    assert done == 4 and [s[0] for s in steps[:-1]] == [1, 3]  # each round's first prompt counted as it completes
    assert len(records) + skipped == 2 and records
    assert all(r["instruction"].endswith("?") and r["response"] for r in records)
    assert any(r["grounded"] and ("Port Imbrey" in r["response"] or "Oskarra" in r["response"]) for r in records)
