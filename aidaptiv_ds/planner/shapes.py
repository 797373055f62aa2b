"""A decoder-only model's shape and its parameters, counted from its hyperparameters alone.

The shape comes from a preset (:data:`aidaptiv_ds.models.presets.PRESETS`) or from a local Hugging Face directory's
config.json, read as JSON (no transformers, no tensors), so a 72B model is sized in microseconds. The
parameter list is the one the transformers Llama/Qwen2/Mistral classes register, in their order
(``model.parameters()``): embeddings; per layer q/k/v/o projections (biases where the config has them),
gate/up/down projections, two RMSNorm weights; the final norm; the LM head unless tied to the embeddings.
DeepSpeed forms optimizer sub-groups and our swapper forms layer groups in that order, so the planner
does too. tests/unit/test_planner_shapes.py checks every count against transformers models built on the
meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

# model_type values whose decoder layers have the Llama structure counted here.
LLAMA_LIKE = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    # ------------------------------------------------------------------ parameters
    def layer_parameters(self) -> List[Tuple[str, int]]:
        """(name, elements) of one decoder layer's parameters, in registration order."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        out = [("q_proj.weight", q * h)] + ([("q_proj.bias", q)] if self.qkv_bias else [])
        out += [("k_proj.weight", kv * h)] + ([("k_proj.bias", kv)] if self.qkv_bias else [])
        out += [("v_proj.weight", kv * h)] + ([("v_proj.bias", kv)] if self.qkv_bias else [])
        out += [("o_proj.weight", h * q)] + ([("o_proj.bias", h)] if self.o_bias else [])
        for name, n_out, n_in in (("gate_proj", f, h), ("up_proj", f, h), ("down_proj", h, f)):
            out.append((f"{name}.weight", n_out * n_in))
            if self.mlp_bias:
                out.append((f"{name}.bias", n_out))
        return out + [("input_layernorm.weight", h), ("post_attention_layernorm.weight", h)]

    def groups(self) -> List[Tuple[str, List[int]]]:
        """The parameters as the swapper groups them, before layer groups are formed: the embeddings, one
        entry per decoder layer, and what follows the layers (final norm, LM head); elements per parameter."""
        embed = ("embed_tokens", [self.vocab * self.hidden])
        layer = [n for _, n in self.layer_parameters()]
        after = [self.hidden] + ([] if self.tied else [self.vocab * self.hidden])
        return [embed] + [(f"layers[{i}]", list(layer)) for i in range(self.layers)] + [("after layers", after)]

    def parameter_numels(self) -> List[int]:
        """Elements of every parameter in ``model.parameters()`` order (a tied head counted once)."""
        return [n for _, numels in self.groups() for n in numels]

    @property
    def num_parameters(self) -> int:
        return sum(self.parameter_numels())

    @property
    def largest_layer_params(self) -> int:
        """Elements of the module with the most parameters of its own: DeepSpeed's ``largest_layer_params``
        (``model_to_params``), the gathered working set its estimator counts."""
        per_module = {}
        for name, n in self.layer_parameters():
            module = name.rsplit(".", 1)[0]
            per_module[module] = per_module.get(module, 0) + n
        return max([self.vocab * self.hidden] + list(per_module.values()))

    @property
    def largest_parameter_numel(self) -> int:
        return max(self.parameter_numels())


def _from_dict(name: str, c: dict) -> ModelShape:
    model_type = c.get("model_type") or c.get("family")
    if model_type not in LLAMA_LIKE:
        raise ValueError(
            f"model {name}: model_type {model_type!r} is not one the planner can size: it knows "
            f"{', '.join(LLAMA_LIKE)} (Llama-shaped decoders)"
        )
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if k not in c
    ]
    if missing:
        raise ValueError(f"model {name}: config lacks {', '.join(missing)}: give a complete config.json")
    h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    attention_bias = bool(c.get("attention_bias", False))
    return ModelShape(
        name=name,
        model_type=model_type,
        hidden=h,
        layers=int(c["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or h // heads),
        intermediate=int(c["intermediate_size"]),
        vocab=int(c["vocab_size"]),
        tied=bool(c.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Mistral follow attention_bias.
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(c.get("mlp_bias", False)),
    )


def resolve_shape(model: str) -> ModelShape:
    """A preset, or a model with weights as ``--model`` names one (a folder, a hub id, a .gguf file: its config
    alone is read, see aidaptiv_ds.models.locate); errors say what is accepted."""
    from aidaptiv_ds.models.locate import config_dict, display_name
    from aidaptiv_ds.models.preset_shapes import PRESETS

    if model in PRESETS:
        return _from_dict(model, PRESETS[model])
    return _from_dict(display_name(model), config_dict(model))


def shape_of_config(name: str, config) -> ModelShape:
    """The shape of a transformers config object (what ``aidaptiv_ds.models.presets.resolve`` made)."""
    return _from_dict(name, config.to_dict())
