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

QLoRA (``bits=4``): :func:`quantize_base` turns the base's linear layers into bitsandbytes nf4 ``Linear4bit``
before the adapters are added; the base is built whole in host memory first (at the training dtype), quantised,
and then partitioned and swapped by ``deepspeed.initialize``, so it must fit in RAM once at that precision.
Its checkpoint exports the adapter only (a 4-bit base is not written as HF weights, nor merged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from aidaptiv_ds.common.extras import missing_message

DEFAULT_TARGETS = ("q_proj", "v_proj")
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file names (PeftModel.from_pretrained reads these)
ADAPTER_WEIGHTS = "adapter_model.safetensors"

QLORA_FILE = "aidaptiv_qlora.json"  # in a checkpoint's hf/ folder: its base holds bitsandbytes 4-bit data
QLORA_QUANT_TYPE = "nf4"  # QLoRA's NormalFloat4 (Dettmers et al. 2023)
QLORA_KEEP = ("lm_head",)  # left unquantised, as transformers' bitsandbytes loader does


@dataclass(frozen=True)
class LoraSpec:
    """What ``--lora`` asked for: rank, alpha (scaling alpha/r), target module names, dropout."""

    r: int
    alpha: float
    targets: Tuple[str, ...]
    dropout: float = 0.0
    bits: int = 16  # 4: QLoRA, the frozen base quantised to bitsandbytes nf4 (see quantize_base)

    def describe(self) -> str:
        what = "QLoRA (nf4 base)" if self.bits == 4 else "LoRA"
        return f"{what} r={self.r} alpha={self.alpha:g} targets={','.join(self.targets)} dropout={self.dropout:g}"

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            target_modules=list(self.targets),
            lora_dropout=self.dropout,
            bias="none",
            task_type="CAUSAL_LM",
        )


def parse_spec(text: str) -> LoraSpec:
    """``r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05][,bits=4]``: keys ``r`` (required), ``alpha``
    (default 2 x r), ``targets`` (module names, default q_proj,v_proj; a comma-separated list runs to the next
    ``key=``), ``dropout`` (default 0), ``bits`` (4: QLoRA; 16 or 32: the base as trained, the default).
    Raises ValueError naming every problem."""
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
                problems.append(f"unknown key {key!r} (expected r, alpha, targets, dropout, bits)")
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
        raise ValueError(f"`lora` {text!r}: {'; '.join(problems)}: write it as r=16,alpha=32,targets=q_proj,v_proj")
    return LoraSpec(
        r=r, alpha=alpha if alpha is not None else 2.0 * r, targets=targets, dropout=dropout or 0.0, bits=bits or 16
    )


def apply(model, spec: LoraSpec):
    """``model`` wrapped by PEFT with ``spec``'s adapters; only the adapters require gradients. Raises
    ValueError when no module of the model matches the targets."""
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in spec.targets if t not in names]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear" and "." in n}
        )
        raise ValueError(
            f"`lora` targets {','.join(missing)}: the model has no module of that name; its linear "
            f"layers are {', '.join(linear)}"
        )
    return get_peft_model(model, spec.peft_config())


def trainable_numel(model) -> int:
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)


def save_adapter_config(model, folder: str) -> None:
    """PEFT's adapter_config.json of ``model`` (a PeftModel) into ``folder`` (the export needs it to merge or
    to write the adapter in PEFT's format)."""
    model.peft_config["default"].save_pretrained(folder)


def quantize_base(model, compute_dtype) -> int:
    """QLoRA's base: every ``nn.Linear`` of ``model`` but the output head becomes bitsandbytes' frozen nf4
    ``Linear4bit`` holding the same weights (quantised), computing in ``compute_dtype``. The packed 4-bit data
    is stored in ``compute_dtype`` elements (bitsandbytes' ``quant_storage``) because ZeRO-3 partitions and
    swaps float parameters; the quantisation constants stay on each weight object, in memory (1/32 of the
    packed bytes with blocks of 64). Call it on a built, unpartitioned model, before :func:`apply`.
    Returns the number of layers quantised. Raises ValueError when bitsandbytes is missing."""
    import torch

    try:
        import bitsandbytes as bnb
    except ImportError as e:
        if e.name == "bitsandbytes":  # not installed, rather than installed and failing to load its library
            raise ValueError(missing_message("`lora` bits=4 (QLoRA)", ["bitsandbytes"])) from None
        raise ValueError(f"`lora` bits=4 needs bitsandbytes, which failed to import: {e}") from None
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is torch.nn.Linear and name.rsplit(".", 1)[-1] not in QLORA_KEEP
    ]
    for name, linear in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        q = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute_dtype,
            quant_type=QLORA_QUANT_TYPE,
            quant_storage=compute_dtype,
            device="meta",
        )
        q.weight = bnb.nn.Params4bit(
            linear.weight.data, requires_grad=False, quant_type=QLORA_QUANT_TYPE, quant_storage=compute_dtype
        ).to(linear.weight.device)  # quantises
        if linear.bias is not None:
            q.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, name.rsplit(".", 1)[-1], q)
    return len(targets)


def save_qlora_marker(folder: str) -> None:
    """Mark a checkpoint whose base is 4-bit (the export must not read its packed data as weights)."""
    import json
    import os

    with open(os.path.join(folder, QLORA_FILE), "w", encoding="utf-8") as f:
        json.dump({"bits": 4, "quant_type": QLORA_QUANT_TYPE, "keep": list(QLORA_KEEP)}, f)
