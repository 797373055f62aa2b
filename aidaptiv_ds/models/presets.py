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
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from aidaptiv_ds.models.preset_shapes import PRESETS  # re-exported: the presets' data

# Qwen2 puts a bias on the q, k and v projections; Llama has no biases.
_QKV_BIAS = {"llama": False, "qwen2": True}


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

    def _counts(self) -> tuple[int, int]:
        """(parameters, largest parameter): config arithmetic for the Llama/Qwen2 shapes, otherwise (a local
        directory of another architecture) a build on the meta device, which allocates nothing."""
        if "counts" not in self.info:
            if getattr(self.config, "model_type", None) in ("llama", "qwen2", "mistral"):
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
    p = dict(PRESETS[name])
    p.pop("nominal_params")
    family = p.pop("family")
    rope = {"rope_type": "default", "rope_theta": p.pop("rope_theta")}
    rope.update(p.pop("rope_scaling", None) or {})
    # The byte tokenizer's specials (tokenizer.py) are valid ids for every preset vocabulary.
    from aidaptiv_ds.models.tokenizer import ByteTokenizer

    specials = dict(bos_token_id=ByteTokenizer.BOS, eos_token_id=ByteTokenizer.EOS, pad_token_id=ByteTokenizer.PAD)
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
    """Parameters of a Llama/Qwen2-shaped causal LM, from its config alone (no tensors are made)."""
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
    """Elements of the largest single parameter (the embedding or an MLP matrix): what swap buffers must hold."""
    s = _shape(config)
    return max(s["vocab"] * s["h"], s["h"] * s["inter"], s["h"] * s["heads"] * s["head_dim"])


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
        model = _model_class(spec.config).from_pretrained(spec.hf_dir, local_files_only=True, dtype=dtype)
        model._aidaptiv_hf_ds_config = hf_ds
        return model
    cls = _model_class(spec.config)
    tied = bool(getattr(spec.config, "tie_word_embeddings", False))
    std = float(getattr(spec.config, "initializer_range", 0.02)) if tied else None
    if init_context is None:
        with _torch_default_init(std):
            return cls(spec.config).to(dtype)
    # zero.Init casts to the dtype of the DeepSpeed config itself (bf16 block on -> bf16, else fp32).
    with _torch_default_init(std), _keep_rope_dtype(), init_context:
        return cls(spec.config)
