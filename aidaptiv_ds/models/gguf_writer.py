"""A Hugging Face folder of a Llama-family model written as one GGUF file, for llama.cpp, Ollama and LM Studio:
its weights (bf16, f16 or q8_0), its hyperparameters, its tokenizer (a byte-level BPE: tokens, their types,
merges, special ids) and its chat template.

What llama.cpp expects of a Llama-shaped model, as gguf-py names it: the tensors under llama.cpp's names
(gguf-py's tensor name map), the query and key projections in llama.cpp's rotary layout (the inverse of the
permutation transformers' GGUF reader undoes), norms in F32 (quantising a vector saves nothing and costs
accuracy), a tied head written once (no ``output.weight``), Llama 3's rope scaling as a ``rope_freqs`` tensor of
per-frequency factors. Tensors go to the file one at a time from the safetensors shards (gguf-py's writer keeps
the tensors it is given until it writes: memory is bounded by one model's weights in the output type, so a model
larger than the host memory is written from a machine that holds it in the output precision).

Supported: Llama (SmolLM2, Llama 2/3.x), Mistral and Qwen2 folders with a byte-level BPE tokenizer (tokenizer.json),
which covers the models this product fine-tunes; others are refused by name. Checked by reading the file back with
transformers' GGUF reader (tests/real/test_gguf_export.py: the weights and logits of the folder).
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Optional

import numpy as np

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
OUT_TYPES = ("bf16", "f16", "q8_0")
# llama.cpp's name for the pre-tokenizer a BPE tokenizer's split rule is (its "tokenizer.ggml.pre"), recognised by
# the digits and letters parts of the split pattern in tokenizer.json; llama.cpp warns on "default".
_PRE_TOKENIZERS = (
    ("\\p{N}{1,3}", "llama-bpe"),  # Llama 3: numbers in groups of up to three digits
    ("\\p{N}|", "qwen2"),  # Qwen2: every digit alone, in a split regex
)


class GGUFExportError(ValueError):
    """A model this writer cannot put in a GGUF file, with what to do."""


def _pre_tokenizer(tokenizer_json: dict) -> str:
    pre = json.dumps(tokenizer_json.get("pre_tokenizer") or {})
    for marker, name in _PRE_TOKENIZERS:
        if marker in pre:
            return name
    if '"Digits"' in pre and '"individual_digits": true' in pre:
        return "smollm"  # GPT-2's byte-level split with every digit alone: SmolLM's
    return "default"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' rotary layout of a query or key projection into llama.cpp's (interleaved halves)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(config) -> Optional[np.ndarray]:
    """Llama 3's rope scaling as the per-frequency factors llama.cpp reads from ``rope_freqs.weight``."""
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if scaling.get("rope_type") != "llama3":
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = scaling.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _check_rope(config) -> None:
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in (None, "default", "llama3"):
        raise GGUFExportError(
            f"the model's rope scaling {kind!r} is not written by this exporter (default and llama3 are): "
            "convert the exported folder with llama.cpp's convert_hf_to_gguf.py"
        )


def write(folder: str, out: str, out_type: str = "bf16", log: Optional[Callable[[str], None]] = None) -> dict:
    """Write the model of Hugging Face ``folder`` to GGUF file ``out``; returns a summary."""
    from aidaptiv_ds.common.extras import missing, missing_message

    if missing("gguf"):
        raise GGUFExportError(missing_message("writing GGUF files", ["gguf"]))
    import gguf
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    if out_type not in OUT_TYPES:
        raise GGUFExportError(f"`gguf_type` {out_type!r}: choose one of {', '.join(OUT_TYPES)}")
    config = AutoConfig.from_pretrained(folder)
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise GGUFExportError(
            f"{folder} holds a {config.model_type!r} model; this exporter writes {', '.join(ARCHITECTURES)} models: "
            "export the Hugging Face folder and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    _check_rope(config)
    tok_path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise GGUFExportError(
            f"{folder} has no tokenizer.json (a byte-level BPE tokenizer is what this exporter writes)"
        )
    with open(tok_path, encoding="utf-8") as f:
        tok_json = json.load(f)
    if (tok_json.get("model") or {}).get("type") != "BPE":
        raise GGUFExportError(f"{tok_path} is not a BPE tokenizer: this exporter writes byte-level BPE tokenizers only")
    if os.path.exists(out):
        raise GGUFExportError(f"{out} exists: give a new file name")

    heads, kv_heads = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qtype = {
        "bf16": gguf.GGMLQuantizationType.BF16,
        "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[out_type]
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[out_type]  # fmt: skip
    w = gguf.GGUFWriter(out, arch)
    w.add_name(os.path.basename(os.path.normpath(folder)))
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # The tokenizer: every id's token (added tokens at their ids; ids past the tokenizer's own, padding of the
    # embedding, as unused placeholders), their types, the merges and special ids, and the chat template.
    vocab = dict(tok_json["model"]["vocab"])
    added = {t["id"]: t for t in tok_json.get("added_tokens", [])}
    for t in added.values():
        vocab[t["content"]] = t["id"]
    by_id = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(config.vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            special = added.get(i)
            types.append(
                gguf.TokenType.NORMAL if special is None
                else gguf.TokenType.CONTROL if special.get("special") else gguf.TokenType.USER_DEFINED
            )  # fmt: skip
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer(tok_json))
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(w)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
                                     config.num_hidden_layers)  # fmt: skip
    index = os.path.join(folder, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    )
    count, nbytes = 0, 0
    factors = _llama3_rope_factors(config)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    for fname in files:
        with safe_open(os.path.join(folder, fname), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                    continue  # the tied head is the embedding: llama.cpp reads token_embd for both
                base, _, suffix = hf_name.rpartition(".")
                gguf_name = names.get_name(base)
                if gguf_name is None:
                    if "rotary_emb" in hf_name:
                        continue
                    raise GGUFExportError(f"{fname}: tensor {hf_name} has no llama.cpp name: not a {arch} layout")
                data = f.get_tensor(hf_name).to(torch.float32).numpy()
                # llama.cpp's llama computes rotary embeddings on interleaved pairs (its qwen2 on halves, as
                # transformers does): only llama's query and key projections are permuted
                if arch == "llama" and base.endswith("self_attn.q_proj"):
                    data = _permute(data, heads)
                elif arch == "llama" and base.endswith("self_attn.k_proj"):
                    data = _permute(data, kv_heads)
                name = f"{gguf_name}.{suffix}"
                if data.ndim == 1:  # norms and biases: F32
                    w.add_tensor(name, data.astype(np.float32))
                elif qtype == gguf.GGMLQuantizationType.F16:
                    w.add_tensor(name, data.astype(np.float16))
                else:
                    w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
                count += 1
                nbytes += data.size
                if log and count % 50 == 0:
                    log(f"converted {count} tensors")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return {"file": out, "type": out_type, "tensors": count, "parameters": nbytes, "bytes": os.path.getsize(out),
            "pre_tokenizer": _pre_tokenizer(tok_json), "architecture": arch}  # fmt: skip
