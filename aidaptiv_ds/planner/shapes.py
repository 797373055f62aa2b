"""A decoder-only model's shape and its parameters, counted from its hyperparameters alone.

The shape comes from a preset (:data:`aidaptiv_ds.models.presets.PRESETS`) or from a local Hugging Face directory's
config.json, read as JSON (no transformers, no tensors), so a 72B model is sized in microseconds. The
parameter list is the one the transformers Llama/Qwen2/Mistral classes register, in their order
(``model.parameters()``): embeddings; per layer q/k/v/o projections (biases where the config has them),
gate/up/down projections, two RMSNorm weights; the final norm; the LM head unless tied to the embeddings.
DeepSpeed forms optimizer sub-groups and our swapper forms layer groups in that order, so the planner
does too. tests/unit/test_planner_shapes.py checks every count against transformers models built on the
meta device.

Mixtures of experts (:data:`MOE_FAMILIES`, transformers 5.23's layouts): a sparse layer's MLP is a block of a
router (``[experts, hidden]``, gpt-oss with a bias) and one ``experts`` module whose two fused parameters hold
every expert (``gate_up_proj``: experts x 2 x intermediate x hidden; ``down_proj``: experts x hidden x
intermediate; gpt-oss adds a bias per expert to each). Qwen3-MoE and OLMoE add RMSNorms on the queries and keys
(Qwen3 per head, OLMoE over the whole projection), gpt-oss a learnt attention sink per head and biases on every
projection. The shape counts every expert (all are trained, so memory is planned with them) and says what one
token uses: ``active_parameters``, the routed experts a token is not sent to left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

# model_type values whose decoder layers have the Llama structure counted here.
LLAMA_LIKE = ("llama", "qwen2", "mistral")
# Mixture-of-experts families (model_type) counted here, in transformers 5.23's layout.
MOE_FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "gpt_oss")
KNOWN = LLAMA_LIKE + MOE_FAMILIES


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
    # mixtures of experts (experts 0: a dense model)
    experts: int = 0  # routed experts per sparse layer
    experts_per_token: int = 0
    expert_intermediate: int = 0  # each expert's intermediate size
    moe_layers: Tuple[int, ...] = ()  # the sparse layers (Qwen3-MoE may keep some dense)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    # ------------------------------------------------------------------ parameters
    def _attention(self) -> List[Tuple[str, int]]:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("self_attn.sinks", self.heads)] if self.model_type == "gpt_oss" else []
        out += [("q_proj.weight", q * h)] + ([("q_proj.bias", q)] if self.qkv_bias else [])
        out += [("k_proj.weight", kv * h)] + ([("k_proj.bias", kv)] if self.qkv_bias else [])
        out += [("v_proj.weight", kv * h)] + ([("v_proj.bias", kv)] if self.qkv_bias else [])
        out += [("o_proj.weight", h * q)] + ([("o_proj.bias", h)] if self.o_bias else [])
        if self.model_type == "qwen3_moe":
            out += [("q_norm.weight", self.head_dim), ("k_norm.weight", self.head_dim)]
        elif self.model_type == "olmoe":
            out += [("q_norm.weight", q), ("k_norm.weight", kv)]
        return out

    def _moe_block(self) -> List[Tuple[str, int]]:
        """A sparse layer's MoE block (``mlp``): its router and its fused experts, in registration order."""
        h, f, e = self.hidden, self.expert_intermediate, self.experts
        if self.model_type == "gpt_oss":
            router = [("mlp.router.weight", e * h), ("mlp.router.bias", e)]
            experts = [
                ("mlp.experts.gate_up_proj", e * h * 2 * f),
                ("mlp.experts.gate_up_proj_bias", e * 2 * f),
                ("mlp.experts.down_proj", e * f * h),
                ("mlp.experts.down_proj_bias", e * h),
            ]
        else:
            router = [("mlp.gate.weight", e * h)]
            experts = [("mlp.experts.gate_up_proj", e * 2 * f * h), ("mlp.experts.down_proj", e * h * f)]
        # Qwen3-MoE's block makes its experts before its router; the others the router first.
        return experts + router if self.model_type == "qwen3_moe" else router + experts

    def layer_parameters(self, index: int = 0) -> List[Tuple[str, int]]:
        """(name, elements) of decoder layer ``index``'s parameters, in registration order."""
        h, f = self.hidden, self.intermediate
        out = self._attention()
        if index in self.moe_layers:
            out += self._moe_block()
        else:
            for name, n_out, n_in in (("gate_proj", f, h), ("up_proj", f, h), ("down_proj", h, f)):
                out.append((f"{name}.weight", n_out * n_in))
                if self.mlp_bias:
                    out.append((f"{name}.bias", n_out))
        return out + [("input_layernorm.weight", h), ("post_attention_layernorm.weight", h)]

    def groups(self) -> List[Tuple[str, List[int]]]:
        """The parameters as the swapper groups them, before layer groups are formed: the embeddings, one
        entry per decoder layer, and what follows the layers (final norm, LM head); elements per parameter."""
        embed = ("embed_tokens", [self.vocab * self.hidden])
        layers = [(f"layers[{i}]", [n for _, n in self.layer_parameters(i)]) for i in range(self.layers)]
        after = [self.hidden] + ([] if self.tied else [self.vocab * self.hidden])
        return [embed] + layers + [("after layers", after)]

    def parameter_numels(self) -> List[int]:
        """Elements of every parameter in ``model.parameters()`` order (a tied head counted once)."""
        return [n for _, numels in self.groups() for n in numels]

    @property
    def num_parameters(self) -> int:
        return sum(self.parameter_numels())

    @property
    def expert_parameters(self) -> int:
        """Elements of the routed experts of the whole model (their biases included; routers not)."""
        per_layer = sum(n for name, n in self._moe_block() if ".experts." in name) if self.is_moe else 0
        return per_layer * len(self.moe_layers)

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward uses: all but the routed experts it is not sent to (the embedding table
        whole; see aidaptiv_ds.models.presets)."""
        if not self.is_moe:
            return self.num_parameters
        return self.num_parameters - self.expert_parameters * (self.experts - self.experts_per_token) // self.experts

    @property
    def largest_layer_params(self) -> int:
        """Elements of the module with the most parameters of its own: DeepSpeed's ``largest_layer_params``
        (``model_to_params``), the gathered working set its estimator counts. An MoE block counts as one module:
        it is a ZeRO-3 leaf (aidaptiv_ds.zero3.moe), gathered whole, router and experts together."""
        dense = [i for i in range(self.layers) if i not in self.moe_layers]
        kinds = dense[:1] + list(self.moe_layers[:1])  # one layer of each kind
        largest = self.vocab * self.hidden
        for index in kinds:
            per_module = {}
            for name, n in self.layer_parameters(index):
                module = "mlp" if name.startswith("mlp.") else name.rsplit(".", 1)[0]
                per_module[module] = per_module.get(module, 0) + n
            largest = max(largest, *per_module.values())
        return largest

    @property
    def largest_parameter_numel(self) -> int:
        return max(self.parameter_numels())


def _moe_fields(model_type: str, c: dict) -> dict:
    """The MoE fields of a config of :data:`MOE_FAMILIES` (each family's own key names), or {} for a dense one."""
    if model_type not in MOE_FAMILIES:
        return {}
    experts = int(c.get("num_local_experts") or c.get("num_experts") or 0)
    layers = int(c["num_hidden_layers"])
    sparse = range(layers)
    if model_type == "qwen3_moe":  # layers may stay dense: mlp_only_layers, decoder_sparse_step
        dense, step = set(c.get("mlp_only_layers") or []), int(c.get("decoder_sparse_step") or 1)
        sparse = [i for i in sparse if i not in dense and experts > 0 and (i + 1) % step == 0]
    return dict(
        experts=experts,
        experts_per_token=int(c.get("num_experts_per_tok") or c.get("experts_per_token") or 0),
        expert_intermediate=int(c["moe_intermediate_size"] if model_type == "qwen3_moe" else c["intermediate_size"]),
        moe_layers=tuple(sparse),
    )


def _from_dict(name: str, c: dict) -> ModelShape:
    model_type = c.get("model_type") or c.get("family")
    if model_type not in KNOWN:
        raise ValueError(
            f"model {name}: model_type {model_type!r} is not one the planner can size: it knows "
            f"{', '.join(LLAMA_LIKE)} (Llama-shaped decoders) and the mixtures of experts {', '.join(MOE_FAMILIES)}"
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
        # Qwen2 always has q/k/v biases and no o_proj bias; Mixtral none; the others follow attention_bias.
        qkv_bias=model_type == "qwen2" or (attention_bias and model_type != "mixtral"),
        o_bias=attention_bias and model_type not in ("qwen2", "mixtral"),
        mlp_bias=bool(c.get("mlp_bias", False)),
        **_moe_fields(model_type, c),
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
