"""LoRA adapters (PEFT) on a base model, from one ``--lora`` spec.

  aidaptiv-ds train --config ds_configs/aidaptiv.json --model tiny --lora r=16,alpha=32,targets=q_proj,v_proj

:func:`parse_spec` turns the spec into a :class:`LoraSpec` (every problem at once, before anything is
built); :func:`apply` wraps a built model with PEFT's ``get_peft_model``. Nothing here writes LoRA by hand:
the adapters, their initialisation and their forward are PEFT's.

With an ``"aidaptiv"`` block the base is built into the NVMe swap space (``zero_init``) and stays there,
frozen: ZeRO-3 gives parameters with ``requires_grad=False`` no gradient hooks and no optimizer state (only
``model_parameters`` reach the optimizer), and our layer-group cache writes a partition only when the
optimizer updated it, so the base is streamed read-only. The adapters, created here after the base was
partitioned, are partitioned by ``deepspeed.initialize`` like any parameter built outside ``zero.Init``;
they and their optimizer state are small enough to stay in the host budget's resident tier.

QLoRA (a 4-bit bitsandbytes base, ``bits=4``) is refused: see :data:`QLORA_REFUSAL` for why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

DEFAULT_TARGETS = ("q_proj", "v_proj")
ADAPTER_CONFIG = "adapter_config.json"     # PEFT's file names (PeftModel.from_pretrained reads these)
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# A try on this CPU (bitsandbytes 0.50.2, DeepSpeed 0.19.8, peft 0.21.2): a micro model quantised to nf4
# Linear4bit (quant_storage fp32) *before* deepspeed.initialize did run 2 LoRA steps through our swapper, its
# first loss equal to the unpartitioned model's (quant_state stays on the Python object; the packed data is
# swapped). What is missing is quantising during the build: presets and HF directories are partitioned into
# the swap space as zero.Init builds them, and nothing here quantises a partitioned weight yet.
QLORA_REFUSAL = (
    "--lora bits=4 (QLoRA) is not supported by 'aidaptiv-ds train' yet: the base is partitioned into the swap "
    "space while it is built, and quantising partitioned weights to bitsandbytes 4-bit is not implemented; "
    "drop bits=4 to train LoRA on the bf16/fp32 base (QLoRA is to be tested on GPU in the GPU issue)")


@dataclass(frozen=True)
class LoraSpec:
    """What ``--lora`` asked for: rank, alpha (scaling alpha/r), target module names, dropout."""

    r: int
    alpha: float
    targets: Tuple[str, ...]
    dropout: float = 0.0

    def describe(self) -> str:
        return f"LoRA r={self.r} alpha={self.alpha:g} targets={','.join(self.targets)} dropout={self.dropout:g}"

    def peft_config(self):
        from peft import LoraConfig
        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=list(self.targets),
                          lora_dropout=self.dropout, bias="none", task_type="CAUSAL_LM")


def parse_spec(text: str) -> LoraSpec:
    """``r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05]``: keys ``r`` (required), ``alpha`` (default
    2 x r), ``targets`` (module names, default q_proj,v_proj; a comma-separated list runs to the next
    ``key=``), ``dropout`` (default 0). Raises ValueError naming every problem."""
    keys = {"r": None, "alpha": None, "targets": None, "dropout": None, "bits": None}
    problems: List[str] = []
    current: Optional[str] = None
    for token in (t.strip() for t in (text or "").split(",")):
        if not token:
            continue
        if "=" in token:
            key, _, value = token.partition("=")
            key = key.strip().lower()
            if key not in keys:
                problems.append(f"unknown key {key!r} (expected r, alpha, targets, dropout)")
                current = None
                continue
            if keys[key] is not None:
                problems.append(f"{key} given twice")
            keys[key] = [value.strip()] if key == "targets" else value.strip()
            current = key
        elif current == "targets":
            keys["targets"].append(token)
        else:
            problems.append(f"{token!r} is not key=value")

    def number(key, cast, ok, want):
        if keys[key] is None:
            return None
        try:
            v = cast(keys[key])
        except ValueError:
            v = None
        if v is None or not ok(v):
            problems.append(f"{key}={keys[key]} must be {want}")
            return None
        return v

    r = number("r", int, lambda v: v >= 1, "a positive integer")
    alpha = number("alpha", float, lambda v: v > 0, "a positive number")
    dropout = number("dropout", float, lambda v: 0 <= v < 1, "in [0, 1)")
    bits = number("bits", int, lambda v: v in (4, 16, 32), "4 (QLoRA), 16 or 32")
    if keys["r"] is None:
        problems.append("r is required (e.g. r=16)")
    targets = tuple(t for t in (keys["targets"] or DEFAULT_TARGETS) if t)
    if not targets:
        problems.append("targets is empty (e.g. targets=q_proj,v_proj)")
    if problems:
        raise ValueError(f"--lora {text!r}: {'; '.join(problems)}: write it as "
                         "r=16,alpha=32,targets=q_proj,v_proj")
    if bits == 4:
        raise ValueError(QLORA_REFUSAL)
    return LoraSpec(r=r, alpha=alpha if alpha is not None else 2.0 * r, targets=targets, dropout=dropout or 0.0)


def apply(model, spec: LoraSpec):
    """``model`` wrapped by PEFT with ``spec``'s adapters; only the adapters require gradients. Raises
    ValueError when no module of the model matches the targets."""
    from peft import get_peft_model
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in spec.targets if t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if type(m).__name__ == "Linear" and "." in n})
        raise ValueError(f"--lora targets {','.join(missing)}: the model has no module of that name; its linear "
                         f"layers are {', '.join(linear)}")
    return get_peft_model(model, spec.peft_config())


def trainable_numel(model) -> int:
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)


def save_adapter_config(model, folder: str) -> None:
    """PEFT's adapter_config.json of ``model`` (a PeftModel) into ``folder`` (the export needs it to merge or
    to write the adapter in PEFT's format)."""
    model.peft_config["default"].save_pretrained(folder)
