"""Model presets: decoder-only transformer shapes built from a transformers config with random weights.

Each preset is the published hyperparameter set of a model family (or one of three small shapes of our own),
so that benchmarks move the same bytes as the real model without downloading any weights. Parameter counts
come from the config arithmetic (``count_parameters``), never from a materialised model, so a 72B preset can
be sized on a laptop. Torch and transformers are imported only when a config or a model is made, so the
harness reads ``PRESETS`` without them.

Our own shapes:

- ``tiny``: the 58M-parameter Llama shape the design measurements use: hidden 768, 6 layers, 12 heads of 64
  (no GQA), intermediate 2048, vocabulary 10,000 with an untied LM head. 6 x 7.08M layer parameters + 2 x 7.68M
  embedding/head = 57.8M. The embedding and head (30.7 MB each in fp32) are the largest partitions.
- ``small``: 226M parameters, hidden 1024, 16 layers, 16 heads, intermediate 2816, vocabulary 10,000 (untied):
  a model whose ZeRO-3 state (about 4.5 GB in fp32) does not fit a few-GiB host-memory cap on a CPU machine,
  for feasibility cells that take about a minute.
- ``micro-tied``: ``micro`` with its LM head tied to the embedding (4.2M parameters), as SmolLM2, Qwen2.5 up to 3B,
  Llama 3.2 and Gemma ship: the fast tests' stand-in for a tied head, whose dropped first weight the swapper
  must give back.
- ``micro``: 4.7M parameters for fast CI runs: hidden 256, 2 layers, 4 heads, intermediate 2048, vocabulary
  2048. Its MLP matrices (256 x 2048), embedding and head are 2 MiB each in fp32, so under ZeRO-Infinity they
  are swapped (DeepSpeed 0.19.8 keeps partitions under 1 MiB in RAM) with 1 rank and, as 1 MiB partitions,
  with 2. (With intermediate 1024 only the embedding and head partitions are swappable at 2 ranks, and
  DeepSpeed's NVMe prefetch then queues the head twice at the forward/backward turn and asserts; see
  ds_configs/README.md.)

Mixtures of experts (MoE): Qwen3-MoE (``qwen3-30b-a3b``, ``qwen3-235b-a22b``), gpt-oss (``gpt-oss-20b``,
``gpt-oss-120b``), Mixtral (``mixtral-8x7b``) and OLMoE (``olmoe-1b-7b``) with their published shapes, and
``micro-moe`` (tests), ``tiny-moe``, ``small-moe``, ``medium-moe`` of our own in the Qwen3-MoE family (a ladder
for the capacity bench: 0.17B, 0.66B, 2.7B). transformers 5.23 lays every family's experts out the same way: one
``experts`` module per MoE layer holding all its experts as two fused 3D parameters, ``gate_up_proj``
(``[experts, 2 x moe_intermediate, hidden]``; gpt-oss stores it transposed, ``[experts, hidden, 2 x
intermediate]``, with a bias per expert) and ``down_proj``, beside a router (``gate`` or ``router``, a
``[experts, hidden]`` weight) in the layer's MoE block (``mlp``). There are no per-expert modules: an expert
is a slice of a parameter. It matters three times: counting (:func:`count_parameters`,
:func:`active_parameters`), ZeRO-3 (a parameter is gathered, partitioned and swapped whole, so a layer's
experts move together, and the MoE block is made a ZeRO-3 leaf module: aidaptiv_ds.zero3.moe), and LoRA
(PEFT's ``target_modules`` finds Linear modules only: the attention projections are the targets, see
aidaptiv_ds.job.lora). Hugging Face checkpoints store experts one by one (``experts.0.w1``...);
``from_pretrained`` fuses them as it loads.

Active parameters are those one token's forward uses: everything but the routed experts it is not sent to
(``num_experts_per_tok`` of ``num_experts`` in each MoE layer), the embedding table counted whole as the
publishers of Qwen3, Mixtral and OLMoE count it (OpenAI's gpt-oss figures leave the input embedding out). The
experts' and routers' parameters, which their constructors leave empty or zero (transformers draws them in its
post-init, which presets skip), are drawn here as a Linear layer's would be (:func:`_draw_moe_parameters`):
a router of zeros would send every token to the first experts.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from dataclasses import dataclass, field

from aidaptiv_ds.models.preset_shapes import PRESET_KEYS, PRESETS  # re-exported: the presets' data

# Qwen2 puts a bias on the q, k and v projections; Llama has no biases.
_QKV_BIAS = {"llama": False, "qwen2": True}
LLAMA_LIKE = ("llama", "qwen2", "mistral")
# The mixture-of-experts families whose shapes are counted from their configs (their layouts: module docstring).
MOE_FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "gpt_oss")


@dataclass
class ModelSpec:
    """What the training job needs to know about a model before (and without) building it."""

    name: str  # preset name or the HF directory as given
    config: object  # a transformers PretrainedConfig
    hf_dir: str | None = None  # set when weights and tokenizer come from a local HF directory
    info: dict = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return self._counts()[0]

    @property
    def largest_parameter_numel(self) -> int:
        return self._counts()[1]

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward uses (all of them for a dense model; see the module docstring)."""
        if getattr(self.config, "model_type", None) in MOE_FAMILIES:
            return active_parameters(self.config)
        return self.num_parameters

    @property
    def is_moe(self) -> bool:
        return getattr(self.config, "model_type", None) in MOE_FAMILIES

    def _counts(self) -> tuple[int, int]:
        """(parameters, largest parameter): config arithmetic for the Llama/Qwen2 and MoE shapes, otherwise (a local
        directory of another architecture) a build on the meta device, which allocates nothing."""
        if "counts" not in self.info:
            if getattr(self.config, "model_type", None) in LLAMA_LIKE + MOE_FAMILIES:
                self.info["counts"] = (count_parameters(self.config), largest_parameter_numel(self.config))
            else:
                import torch

                with torch.device("meta"):
                    model = _model_class(self.config)(self.config)
                numels = [p.numel() for p in model.parameters()]
                self.info["counts"] = (sum(numels), max(numels))
        return self.info["counts"]


def preset_names() -> list[str]:
    return list(PRESETS)


def nominal_parameters(name: str) -> int | None:
    """The parameter count a preset is known by (see PRESETS), or None for a name that is no preset."""
    preset = PRESETS.get(name)
    return preset["nominal_params"] if preset else None


def preset_config(name: str):
    """The transformers config of a preset (no weights)."""
    if name not in PRESETS:
        raise ValueError(
            f"model preset {name!r} is unknown: choose one of {', '.join(PRESETS)} "
            "or give a local Hugging Face model directory"
        )
    p = {k: v for k, v in PRESETS[name].items() if k not in PRESET_KEYS}
    family = PRESETS[name]["family"]
    rope = {"rope_type": "default", "rope_theta": p.pop("rope_theta")}
    rope.update(p.pop("rope_scaling", None) or {})
    # The byte tokenizer's specials (tokenizer.py) are valid ids for every preset vocabulary.
    from aidaptiv_ds.models.tokenizer import ByteTokenizer

    specials = dict(bos_token_id=ByteTokenizer.BOS, eos_token_id=ByteTokenizer.EOS, pad_token_id=ByteTokenizer.PAD)
    if family in MOE_FAMILIES:
        from transformers import AutoConfig

        return AutoConfig.for_model(family, rope_parameters=rope, **specials, **p)
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(rope_parameters=rope, attention_bias=False, mlp_bias=False, **specials, **p)
    from transformers import Qwen2Config

    return Qwen2Config(rope_parameters=rope, use_sliding_window=False, **specials, **p)


def _shape(config) -> dict:
    h = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    if config.model_type == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(getattr(config, "attention_bias", False))
    return dict(
        h=h,
        heads=heads,
        kv=kv,
        head_dim=head_dim,
        inter=config.intermediate_size,
        layers=config.num_hidden_layers,
        vocab=config.vocab_size,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2",
    )


def count_parameters(config) -> int:
    """Parameters of a Llama/Qwen2-shaped or MoE causal LM, from its config alone (no tensors are made)."""
    if config.model_type in MOE_FAMILIES:
        return _moe_counts(config)["total"]
    s = _shape(config)
    h, q_out, kv_out = s["h"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
    attn = h * q_out + 2 * h * kv_out + q_out * h
    if s["qkv_bias"]:
        attn += q_out + 2 * kv_out
    if s["o_bias"]:
        attn += h
    mlp = 3 * h * s["inter"] + ((2 * s["inter"] + h) if s["mlp_bias"] else 0)
    layer = attn + mlp + 2 * h  # two RMSNorm weights
    embed = s["vocab"] * h
    return embed * (1 if s["tied"] else 2) + s["layers"] * layer + h  # + final norm


def largest_parameter_numel(config) -> int:
    """Elements of the largest single parameter (the embedding, an MLP matrix, a layer's fused experts):
    what swap buffers must hold."""
    if config.model_type in MOE_FAMILIES:
        return _moe_counts(config)["largest"]
    s = _shape(config)
    return max(s["vocab"] * s["h"], s["h"] * s["inter"], s["h"] * s["heads"] * s["head_dim"])


def active_parameters(config) -> int:
    """Parameters one token's forward uses: all of a dense model's; of an MoE model, all but the routed experts the
    token is not sent to (``num_experts_per_tok`` of ``num_experts`` per MoE layer), the embedding table whole."""
    if config.model_type in MOE_FAMILIES:
        return _moe_counts(config)["active"]
    return count_parameters(config)


def moe_layer_indices(config) -> list[int]:
    """The decoder layers whose MLP is a mixture of experts (Qwen3-MoE can keep some dense: ``mlp_only_layers``,
    ``decoder_sparse_step``; the other families' layers are all sparse)."""
    layers = range(config.num_hidden_layers)
    if config.model_type != "qwen3_moe":
        return list(layers)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return [i for i in layers if i not in dense and config.num_experts > 0 and (i + 1) % step == 0]


def _moe_counts(config) -> dict:
    """Total, active and largest-parameter elements of a :data:`MOE_FAMILIES` model, from its config (the layouts
    of transformers 5.23, checked against meta builds by tests/unit/test_models.py)."""
    family = config.model_type
    h, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q_out, kv_out = heads * head_dim, kv * head_dim
    bias = bool(getattr(config, "attention_bias", False)) and family != "mixtral"
    attn = 2 * h * q_out + 2 * h * kv_out + ((q_out + 2 * kv_out + h) if bias else 0)
    attn += {"qwen3_moe": 2 * head_dim, "olmoe": q_out + kv_out, "gpt_oss": heads}.get(family, 0)  # norms, sinks
    experts = config.num_local_experts if family in ("mixtral", "gpt_oss") else config.num_experts
    top_k = config.num_experts_per_tok
    f = config.intermediate_size if family != "qwen3_moe" else config.moe_intermediate_size
    expert = 3 * h * f + ((2 * f + h) if family == "gpt_oss" else 0)  # one expert's gate, up and down (biases)
    router = experts * h + (experts if family == "gpt_oss" else 0)
    sparse = len(moe_layer_indices(config))
    dense = config.num_hidden_layers - sparse
    embed = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    common = embed + h + config.num_hidden_layers * (attn + 2 * h) + dense * 3 * h * config.intermediate_size
    return {
        "total": common + sparse * (router + experts * expert),
        "active": common + sparse * (router + top_k * expert),
        "largest": max(
            config.vocab_size * h, experts * 2 * f * h, h * q_out, h * config.intermediate_size if dense else 0
        ),
    }


def resolve(model: str, log=None) -> ModelSpec:
    """A preset name, or a model with weights: a local HF folder, a hub id or a .gguf file, found (or converted)
    as a local folder by :func:`aidaptiv_ds.models.locate.model_folder` (config.json read from disk)."""
    if model in PRESETS:
        return ModelSpec(name=model, config=preset_config(model))
    from aidaptiv_ds.models.locate import display_name, model_folder

    folder = model_folder(model, log=log)
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise ValueError(
            f"`model` {model} is a directory without config.json: give a Hugging Face model "
            "directory (config.json, weights, tokenizer files)"
        )
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    return ModelSpec(name=display_name(model), config=config, hf_dir=folder)


def _model_class(config):
    from transformers import AutoModelForCausalLM

    # _model_mapping is public enough: AutoModelForCausalLM.from_config uses the same lookup.
    return AutoModelForCausalLM._model_mapping[type(config)]


@contextlib.contextmanager
def _keep_rope_dtype():
    """zero.Init casts every float tensor made inside it to the training dtype; RoPE's arange-based inverse
    frequencies must stay fp32 (transformers' own guard, entered before zero.Init as it requires)."""
    try:
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:  # older/newer transformers without it: nothing to guard
        yield
        return
    with prevent_arange_dtype_change():
        yield


def _draw_moe_parameters(module) -> None:
    """Draw the parameters an MoE family's constructors leave empty (``torch.empty``) or zero, as torch's Linear
    draws a weight and a bias (uniform within 1/sqrt(fan_in)): each expert's slice of the fused ``[experts, out,
    in]`` parameters (``[experts, in, out]`` where the layout is transposed, gpt-oss) and its bias, the router's
    weight and bias. gpt-oss's attention sinks (a logit per head) start at zero. Only the module's own
    parameters are touched: norms keep their ones, Linear layers their own draws."""
    import torch

    own = dict(module.named_parameters(recurse=False))
    fused = {n: p for n, p in own.items() if p.dim() == 3}
    router = type(module).__name__.endswith("Router")
    with torch.no_grad():
        for name, p in fused.items():
            fan_in = p.shape[1] if getattr(module, "is_transposed", False) else p.shape[2]
            p.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
            bias = own.get(f"{name}_bias")
            if bias is not None:
                bias.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        if router and "weight" in own:
            fan_in = own["weight"].shape[-1]
            for n in ("weight", "bias"):
                if n in own:
                    own[n].uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        if "sinks" in own:
            own["sinks"].zero_()


@contextlib.contextmanager
def _moe_draws(model_class):
    """While a model of ``model_class`` is built, every module class of its modeling file draws its MoE parameters
    (:func:`_draw_moe_parameters`) as soon as its constructor returns: under zero.Init a submodule is partitioned
    right after its own __init__, so a draw after the whole model is built would find empty partitions. This
    wrapper is installed before zero.Init wraps the constructors, so it runs inside them, before partitioning."""
    import torch

    module = sys.modules.get(model_class.__module__)
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type)
        and issubclass(c, torch.nn.Module)
        and c.__module__ == module.__name__
        and "__init__" in vars(c)
    ]
    originals = {c: c.__dict__["__init__"] for c in classes}

    def drawing(original):
        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _draw_moe_parameters(self)

        return __init__

    for c, original in originals.items():
        c.__init__ = drawing(original)
    try:
        yield
    finally:
        for c, original in originals.items():
            c.__init__ = original


@contextlib.contextmanager
def _torch_default_init(tied_embedding_std: float | None = None):
    """Leave weights as torch's module constructors draw them (Linear: kaiming-uniform, Embedding: N(0, 1),
    norms: ones) and skip transformers' post-init re-initialisation.

    ``tied_embedding_std``: embeddings drawn from N(0, std) instead, for a model whose output layer is its
    embedding (Qwen2.5-3B). N(0, 1) rows as the output layer give logits of standard deviation sqrt(hidden)
    (45 at hidden 2048): a first loss of about 1200 instead of ln(vocab), 12.

    Under zero.Init each submodule is partitioned as soon as its own __init__ returns, so by the time
    transformers' post_init runs on the whole model every weight is an empty partition stub; its init either
    does nothing or fails (indexing the padding row of an empty embedding). The constructors' draws happen on
    whole tensors before partitioning, so they give the same model with and without ZeRO-3 for a given seed.
    """
    import torch
    from transformers import PreTrainedModel

    original = PreTrainedModel.init_weights
    original_embedding_init = torch.nn.Embedding.reset_parameters

    def tie_only(self):
        self.tie_weights(recompute_mapping=False)

    def small_embedding_init(self):
        torch.nn.init.normal_(self.weight, mean=0.0, std=tied_embedding_std)
        self._fill_padding_idx_with_zero()

    PreTrainedModel.init_weights = tie_only
    if tied_embedding_std is not None:
        torch.nn.Embedding.reset_parameters = small_embedding_init
    try:
        yield
    finally:
        PreTrainedModel.init_weights = original
        torch.nn.Embedding.reset_parameters = original_embedding_init


def build_model(spec: ModelSpec, dtype, init_context=None, ds_config: dict | None = None):
    """Construct the model.

    Presets get random weights. Under ZeRO-3 ``init_context`` is a ``deepspeed.zero.Init`` (or our own
    equivalent): every submodule is partitioned (and for NVMe offload, written to swap) as soon as it is built,
    so a preset bigger than host RAM never exists whole. Weights are drawn by torch's default initialisers
    from the global RNG (see _torch_default_init), so the same seed gives the same model on every rank and
    with every backend.

    A local HF directory is loaded with ``from_pretrained(local_files_only=True)``; under ZeRO-3 transformers
    itself wraps construction in zero.Init when an ``HfDeepSpeedConfig`` is alive, which this function keeps
    alive on the returned model (``model._aidaptiv_hf_ds_config``).
    """
    if spec.hf_dir is not None:
        hf_ds = None
        if init_context is not None and ds_config is not None:
            from transformers.integrations import HfDeepSpeedConfig

            hf_ds = HfDeepSpeedConfig(ds_config)  # must outlive from_pretrained (transformers keeps a weakref)
        # The config object, not the folder's file again: train may have set fields of it (a mixture of experts'
        # output_router_logits and router_aux_loss_coef).
        model = _model_class(spec.config).from_pretrained(
            spec.hf_dir, config=spec.config, local_files_only=True, dtype=dtype
        )
        model._aidaptiv_hf_ds_config = hf_ds
        return model
    cls = _model_class(spec.config)
    tied = bool(getattr(spec.config, "tie_word_embeddings", False))
    std = float(getattr(spec.config, "initializer_range", 0.02)) if tied else None
    draws = _moe_draws(cls) if spec.is_moe else contextlib.nullcontext()
    if init_context is None:
        with _torch_default_init(std), draws:
            return cls(spec.config).to(dtype)
    # zero.Init casts to the dtype of the DeepSpeed config itself (bf16 block on -> bf16, else fp32).
    with _torch_default_init(std), draws, _keep_rope_dtype(), init_context:
        return cls(spec.config)
