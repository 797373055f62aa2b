"""Where --model finds a model (aidaptiv_ds.models.locate): a preset, a folder, a hub id through huggingface_hub's
cache (laid out here by hand, as `hf download` leaves it: no network), and what is refused, with what to do."""

import json
import os
import subprocess
import sys

import pytest

from aidaptiv_ds.models import gguf, hub, locate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _tiny_folder(folder):
    """A real (tiny) Llama folder with weights and the byte tokenizer, as save_pretrained writes it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aidaptiv_ds.models.tokenizer import save_byte_tokenizer

    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=300,
        tie_word_embeddings=True,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    save_byte_tokenizer(str(folder))
    return folder


def _hub_cache(home, repo_id, source):
    """``source``'s files as huggingface_hub keeps a downloaded snapshot: blobs, refs/main, snapshots/<commit>."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name in os.listdir(source):
        (snap / name).write_bytes((source / name).read_bytes())
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    # huggingface_hub reads these once, at import: run what uses them in a fresh process
    return home


def _in_child(code, env_home):
    env = dict(os.environ, HF_HOME=str(env_home), HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_a_hub_id_in_the_cache_is_found_without_the_network(tmp_path, offline_hub):
    snap = _hub_cache(offline_hub, "someorg/tiny-llama", _tiny_folder(tmp_path / "src"))
    out = _in_child(
        "from aidaptiv_ds.models import locate, presets, hub\n"
        "print(locate.model_folder('someorg/tiny-llama'))\n"
        "spec = presets.resolve('someorg/tiny-llama')\n"
        "print(spec.name, spec.hf_dir, spec.config.tie_word_embeddings)\n"
        "print(locate.config_dict('someorg/tiny-llama@main')['hidden_size'])\n",
        offline_hub,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == str(snap)
    assert lines[1] == f"tiny-llama {snap} True" and lines[2] == "64"


def test_a_hub_id_not_in_the_cache_offline_says_what_to_do(offline_hub):
    out = _in_child(
        "from aidaptiv_ds.models import locate\n"
        "try:\n    locate.model_folder('someorg/absent-model')\n"
        "except ValueError as e:\n    print(type(e).__name__, e)\n",
        offline_hub,
    )
    assert out.returncode == 0, out.stderr
    said = out.stdout
    assert said.startswith("HubError model 'someorg/absent-model' is not in the Hugging Face cache (")
    assert str(offline_hub) in said and "HF_HUB_OFFLINE is set" in said and "hf download someorg/absent-model" in said


def test_the_train_and_generate_commands_take_a_hub_id(tmp_path, offline_hub):
    """generate runs a cached hub model by its id (the command line users type), with the network off."""
    _hub_cache(offline_hub, "someorg/tiny-llama", _tiny_folder(tmp_path / "src"))
    env = dict(os.environ, HF_HOME=str(offline_hub), HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "aidaptiv_ds",
            "generate",
            "--model",
            "someorg/tiny-llama",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "3",
            "--metrics-out",
            str(tmp_path / "m.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "m.json").read_text())["results"][0]["new_tokens"] >= 1


def test_forms_that_are_no_model_are_refused_with_the_accepted_forms(tmp_path):
    with pytest.raises(ValueError, match="is not a preset, a local Hugging Face folder, a hub id"):
        locate.model_folder("no-such-thing")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        locate.model_folder(str(tmp_path / "weights.bin"))
    assert locate.model_folder("micro") is None
    assert locate.model_folder(str(tmp_path)) == str(tmp_path)
    assert hub.looks_like_hub_id("Qwen/Qwen2.5-7B-Instruct") and hub.looks_like_hub_id("a/b@v1.0")
    assert not hub.looks_like_hub_id(str(tmp_path)) and not hub.looks_like_hub_id("tiny")
    assert locate.display_name("Qwen/Qwen2.5-7B-Instruct@main") == "Qwen2.5-7B-Instruct"
    assert locate.display_name("/models/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"


def test_a_gguf_file_that_is_not_one_is_refused_by_name(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(gguf.GGUFError, match="is not a readable GGUF file"):
        locate.model_folder(str(bad))
    with pytest.raises(gguf.GGUFError, match="does not exist"):
        gguf.describe(str(tmp_path / "absent.gguf"))


def test_a_gguf_of_another_architecture_or_quantisation_is_refused_by_name(tmp_path):
    """Files written with gguf-py's own writer: a 'gpt2' model, and a llama model with an IQ2_XXS tensor."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    def write(path, arch, dtype=None):
        w = GGUFWriter(str(path), arch)
        w.add_name("test")
        if dtype is None:
            w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        else:  # raw bytes in a type gguf-py does not dequantize
            w.add_tensor("token_embd.weight", np.zeros((66,), dtype=np.uint8), raw_shape=(1, 66), raw_dtype=dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(gguf.GGUFError, match="holds a 'gpt2' model .*takes GGUF files of llama, mistral, qwen2, qwen3"):
        gguf.describe(str(tmp_path / "gpt2.gguf"))
    write(tmp_path / "iq.gguf", "llama", GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(gguf.GGUFError, match="holds tensors in IQ2_XXS, which this product does not dequantize"):
        gguf.describe(str(tmp_path / "iq.gguf"))
