"""--model with a local Hugging Face directory: config, weights and tokenizer all come from disk."""

import os

import pytest
import torch
from helpers import CONFIGS, read_metrics, run_train


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small Llama checkpoint with its own BPE tokenizer, made offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from aidaptiv_ds.job.data import DEFAULT_DATA, load_texts
    from aidaptiv_ds.models.presets import preset_config

    path = tmp_path_factory.mktemp("hf_model")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        load_texts(DEFAULT_DATA), trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.save_pretrained(path)
    config = preset_config("micro")
    config.vocab_size = 640
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # weights no random initialiser would give: proves they were loaded
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(path)
    return path


def reference_first_loss(path, seq_len, micro_batch, seed):
    from transformers import LlamaForCausalLM

    from aidaptiv_ds.job.data import DEFAULT_DATA, build_batches
    from aidaptiv_ds.models.tokenizer import HFTokenizer

    model = LlamaForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    batch = build_batches(DEFAULT_DATA, HFTokenizer(str(path)), seq_len, micro_batch, seed, 0, 1).batch(0)
    with torch.no_grad():
        return float(model(**batch).loss)


def test_train_from_local_hf_directory(tmp_path, hf_dir):
    metrics = tmp_path / "m.json"
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "zero3.json"),
            "--model",
            str(hf_dir),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--seq-len",
            "64",
            "--metrics-out",
            str(metrics),
            "--no-progress",
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    m = read_metrics(metrics)
    assert m["status"] == "ok" and m["model"] == os.path.basename(str(hf_dir))
    assert m["tokenizer"] != "byte"
    from aidaptiv_ds.models.presets import count_parameters, resolve

    assert m["params"] == count_parameters(resolve(str(hf_dir)).config)
    # The first loss is the saved weights' loss on the first batch, computed here without DeepSpeed.
    assert m["losses"][0] == pytest.approx(reference_first_loss(hf_dir, 64, 2, 1234), rel=1e-4)
