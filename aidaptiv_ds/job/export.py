"""Export a checkpoint's weights as a Hugging Face model folder, in bounded memory.

  aidaptiv-ds export CKPT_DIR --out MODEL_DIR [--max-shard-size 5GB] [--model PRESET|HF_DIR] [--merge-lora]

Checkpoints of ``train --lora`` (see :class:`LoraExport`): the base under transformers' names (merged with
the adapters under --merge-lora) and the adapter in PEFT's format in ``MODEL_DIR/adapter``.

Reads the per-rank files an aidaptiv run saves (``<save_dir>/<tag>/aidaptiv/rank<r>/params.bin`` and its
``manifest.json``: every parameter by name, shape, partition size and byte offset) with the format's reader,
:class:`aidaptiv_ds.swap.checkpoint_format.Checkpoint`, and writes ``model.safetensors`` (or
``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``), ``config.json`` and the
tokenizer files, which ``AutoModelForCausalLM.from_pretrained(MODEL_DIR)`` loads. Weights keep the dtype the
model was trained in.

A parameter is the ranks' ZeRO-3 slices in rank order, cut to its size. Since every shape is in the manifest,
each shard's safetensors header is known before a byte is copied, so the shard is written as a stream: the
slices go from params.bin to the shard file through one buffer of ``COPY_BUFFER`` bytes. Memory stays at that
buffer however large the model or a single tensor is (a 70B model exports on a machine with a few GiB of
RAM). The format is the one the safetensors library defines (8-byte header length, JSON header, data); the
tests read the files back with that library and with transformers.

The weights are verified before anything is written, as a resume verifies them (:func:`verify`): a block of
params.bin that does not match its checksum, or a NaN or inf in a parameter, is refused with the file, the
byte range or offset, and what to do. Checkpoints of plain DeepSpeed runs (no "aidaptiv" block) keep their
weights in DeepSpeed's own files and are refused with a message. Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Dict, List, Optional

from aidaptiv_ds.common.sizes import parse_size
from aidaptiv_ds.job.model_files import copy_model_files, save_model_files
from aidaptiv_ds.swap.checkpoint_format import (
    MODEL_FILES,
    Checkpoint,
    CheckpointMismatchError,
    read_pieces,
    resolve_checkpoint,
)

COPY_BUFFER = 64 * 1024 * 1024
DEFAULT_SHARD = "5GB"

# safetensors' dtype names, by the names the manifest uses (torch's, without "torch.")
_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


class ExportError(ValueError):
    """A checkpoint that cannot be exported, with what to do about it."""


# ------------------------------------------------------------------------------------------- reading


def torch_uint8():
    import torch

    return torch.uint8


def read_tensor(ck: Checkpoint, name: str):
    """One parameter of the checkpoint, whole, as a torch tensor of its shape and dtype."""
    import torch

    p = ck.parameters[name]
    t = torch.empty(p["numel"], dtype=getattr(torch, ck.dtype))
    read_pieces(ck.pieces(name), memoryview(t.view(torch.uint8).numpy()), f"parameter {name}", ExportError)
    return t.view(p["shape"])


# ------------------------------------------------------------------------------------------- writing


def plan_shards(sizes: Dict[str, int], max_shard_bytes: int) -> List[List[str]]:
    """Names grouped into shards of at most ``max_shard_bytes`` each, in order (a tensor larger than that
    gets a shard of its own, as transformers does)."""
    shards: List[List[str]] = [[]]
    total = 0
    for name, n in sizes.items():
        if shards[-1] and total + n > max_shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += n
    return shards if shards[0] else []


def _header(ck: Checkpoint, names: List[str], rename: Optional[Dict[str, str]] = None) -> bytes:
    st = _ST_DTYPE[ck.dtype]
    h, pos = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        n = ck.nbytes(name)
        out = (rename or {}).get(name, name)
        h[out] = {"dtype": st, "shape": list(ck.parameters[name]["shape"]), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(h, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(raw)) + raw


def _write_shard(
    ck: Checkpoint,
    names: List[str],
    path: str,
    buf: bytearray,
    rename: Optional[Dict[str, str]] = None,
    computed: Optional[Dict[str, "callable"]] = None,
) -> None:
    """Stream ``names`` from the checkpoint into one safetensors file (named as ``rename`` says); a name in
    ``computed`` is written from the tensor its function returns instead (a merged LoRA weight: one tensor
    in memory at a time)."""
    tmp = path + ".partial"
    view = memoryview(buf)
    with open(tmp, "wb") as out:
        out.write(_header(ck, names, rename))
        sources: Dict[str, int] = {}
        try:
            for name in names:
                if computed and name in computed:
                    out.write(computed[name]().contiguous().view(-1).view(torch_uint8()).numpy().tobytes())
                    continue
                for src, offset, nbytes in ck.pieces(name):
                    fd = sources.get(src)
                    if fd is None:
                        fd = sources[src] = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
                    done = 0
                    while done < nbytes:
                        n = min(len(buf), nbytes - done)
                        got = os.preadv(fd, [view[:n]], offset + done)
                        if got <= 0:
                            raise ExportError(
                                f"checkpoint file {src} ends at byte {offset + done}, parameter "
                                f"{name} needs {nbytes - done} more: the checkpoint is damaged"
                            )
                        out.write(view[:got])
                        done += got
        finally:
            for fd in sources.values():
                os.close(fd)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


ADAPTER_DIR = "adapter"  # <out>/adapter/: the LoRA adapter in PEFT's format (PeftModel.from_pretrained)
_PEFT_PREFIX = "base_model.model."


class LoraExport:
    """How a checkpoint of a PEFT model (``aidaptiv-ds train --lora``) is written: the base weights under
    the names transformers gives them (``base_model.model.`` and ``.base_layer`` dropped), merged with
    ``W + scaling * B @ A`` when ``merge`` (one weight in memory at a time), and the adapter tensors under
    the names PEFT saves (adapter name dropped) with the adapter_config.json the train job saved."""

    def __init__(self, ck: Checkpoint, files_dir: str, merge: bool):
        from aidaptiv_ds.job.lora import ADAPTER_CONFIG

        self.ck = ck
        path = os.path.join(files_dir, ADAPTER_CONFIG)
        if not os.path.isfile(path):
            raise ExportError(
                f"checkpoint {ck.tag_dir} holds LoRA adapters but no {MODEL_FILES}/{ADAPTER_CONFIG}: "
                "it was not saved by 'aidaptiv-ds train --lora'; export it with PEFT instead"
            )
        with open(path, encoding="utf-8") as f:
            self.config = json.load(f)
        if self.config.get("rank_pattern") or self.config.get("alpha_pattern"):
            raise ExportError(
                f"{path} has a rank_pattern or alpha_pattern, which this exporter does not merge: "
                "export it with PEFT's merge_and_unload"
            )
        r, alpha = float(self.config["r"]), float(self.config["lora_alpha"])
        self.scaling = alpha / (r**0.5) if self.config.get("use_rslora") else alpha / r
        adapters = [n for n in ck.parameters if ".lora_" in n]
        others = [n for n in ck.parameters if n not in set(adapters)]
        if any(not n.startswith(_PEFT_PREFIX) for n in ck.parameters):
            raise ExportError(
                f"checkpoint {ck.tag_dir} holds lora_ parameters outside a PEFT model "
                f"(names not under {_PEFT_PREFIX}): it was not saved by 'aidaptiv-ds train --lora'"
            )
        self.base_names = others
        self.rename = {n: n[len(_PEFT_PREFIX) :].replace(".base_layer.", ".") for n in others}
        # adapter tensors as PEFT saves them: "...q_proj.lora_A.weight" (".default" is the adapter's name)
        self.adapter_rename = {n: n.replace(".default.", ".") for n in adapters}
        self.computed = {}
        if merge:
            for n in others:
                if ".base_layer.weight" not in n:
                    continue
                stem = n[: -len(".base_layer.weight")]
                a, b = f"{stem}.lora_A.default.weight", f"{stem}.lora_B.default.weight"
                if a in ck.parameters and b in ck.parameters:
                    self.computed[n] = lambda w=n, a=a, b=b: self.merged(w, a, b)

    def merged(self, w: str, a: str, b: str):
        ck = self.ck
        weight = read_tensor(ck, w)
        delta = read_tensor(ck, b).float() @ read_tensor(ck, a).float()
        return (weight.float() + self.scaling * delta).to(weight.dtype)

    def write_adapter(self, out: str, buf: bytearray) -> List[str]:
        from aidaptiv_ds.job.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        folder = os.path.join(out, ADAPTER_DIR)
        os.makedirs(folder, exist_ok=True)
        config = dict(self.config, base_model_name_or_path=os.path.abspath(out))
        with open(os.path.join(folder, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        _write_shard(
            self.ck, list(self.adapter_rename), os.path.join(folder, ADAPTER_WEIGHTS), buf, self.adapter_rename
        )
        return [f"{ADAPTER_DIR}/{ADAPTER_CONFIG}", f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}"]


def verify(ck: Checkpoint, log=None) -> None:
    """Refuse weights a resume would refuse: every rank's params.bin against the CRC32 of each block in its
    manifest, and finite values where a parameter holds numbers (a pass of its own, through one buffer of at
    most 16 MiB, before the copy: a block's checksum covers bytes the copy reads in another order)."""
    from aidaptiv_ds.swap.checkpoint_verify import EXPORT_AGAIN, verify_weights

    try:
        verified = verify_weights(ck, EXPORT_AGAIN)
    except CheckpointMismatchError as e:
        raise ExportError(str(e)) from None
    if not verified:
        unverified = f"checkpoint {ck.tag_dir} has no checksums (saved before aidaptiv-ds wrote them): its weights are not verified"
        if log:
            log(unverified)
        else:
            logging.getLogger(__name__).warning(unverified)


def out_problem(out: str) -> Optional[str]:
    """Why ``out`` cannot receive a model (it holds weights already, or is a file), or None."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"output folder {out} is a file: give a new or empty folder"
    for f in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            return f"output folder {out} already holds model weights ({f}): give a new or empty folder"
    return None


def export(
    checkpoint: str, out: str, max_shard_size="5GB", model: Optional[str] = None, merge_lora: bool = False, log=None
) -> dict:
    """Write the model of ``checkpoint`` (a tag folder or a save dir) to ``out`` as a Hugging Face folder.
    ``model`` (a preset or local HF directory) supplies config and tokenizer when the checkpoint has no hf/
    folder. Returns a summary (files, bytes, tensors)."""
    try:
        tag_dir = resolve_checkpoint(checkpoint)
        ck = Checkpoint(tag_dir)
    except CheckpointMismatchError as e:
        raise ExportError(str(e)) from None
    if merge_lora and not ck.has_adapters:
        raise ExportError(
            f"`merge_lora`: checkpoint {tag_dir} has no LoRA adapters (no lora_ parameters); drop "
            "it to export its full weights"
        )
    files_dir = os.path.join(tag_dir, MODEL_FILES)
    from aidaptiv_ds.job.lora import QLORA_FILE

    qlora = os.path.isfile(os.path.join(files_dir, QLORA_FILE))
    if qlora and merge_lora:
        raise ExportError(
            f"`merge_lora`: checkpoint {tag_dir} is QLoRA (its base holds bitsandbytes 4-bit data, "
            f"{MODEL_FILES}/{QLORA_FILE}), which is not merged into HF weights: drop `merge_lora` to "
            "export the adapter, and merge it with PEFT on the original base"
        )
    lora = LoraExport(ck, files_dir, merge_lora) if ck.has_adapters else None
    limit = (
        parse_size(max_shard_size, what="`max_shard_size`") if isinstance(max_shard_size, str) else int(max_shard_size)
    )
    if limit < 1:
        raise ExportError(f"`max_shard_size` {max_shard_size} must be a positive size such as 5GB")
    if model is None and not os.path.isfile(os.path.join(files_dir, "config.json")):
        raise ExportError(
            f"checkpoint {tag_dir} has no {MODEL_FILES}/config.json (saved by an older aidaptiv-ds, "
            "or not by aidaptiv-ds train): give `model`, the preset or HF directory it trained"
        )
    problem = out_problem(out)
    if problem:
        raise ExportError(problem)
    verify(ck, log)  # before anything is written: a refused checkpoint leaves no folder behind
    os.makedirs(out, exist_ok=True)
    if model is None:
        copied = copy_model_files(files_dir, out)
    else:
        from aidaptiv_ds.models import presets as models
        from aidaptiv_ds.models.tokenizer import tokenizer_for

        spec = models.resolve(model)
        save_model_files(spec, tokenizer_for(spec), out, dtype=ck.dtype)
        copied = sorted(os.listdir(out))
    if qlora:  # the adapter alone: the base's packed 4-bit data are no HF weights
        files = lora.write_adapter(out, bytearray(COPY_BUFFER))
        if log:
            log(
                f"QLoRA checkpoint: the adapter in PEFT's format in {os.path.join(out, ADAPTER_DIR)} "
                "(load it with PeftModel.from_pretrained on the original base)"
            )
        return {
            "checkpoint": tag_dir,
            "out": out,
            "files": files + copied,
            "tensors": len(lora.adapter_rename),
            "bytes": sum(ck.nbytes(n) for n in lora.adapter_rename),
            "dtype": ck.dtype,
            "world_size": ck.world_size,
            "qlora": True,
        }
    base = lora.base_names if lora else list(ck.parameters)
    rename = lora.rename if lora else {}
    sizes = {name: ck.nbytes(name) for name in base}
    shards = plan_shards(sizes, limit)
    buf = bytearray(min(COPY_BUFFER, max(sizes.values(), default=1)))
    files = []
    for i, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(ck, names, os.path.join(out, fname), buf, rename, lora.computed if lora else None)
        files.append(fname)
        if log:
            log(f"wrote {fname} ({len(names)} tensors, {sum(sizes[n] for n in names):,} bytes)")
    if lora:
        files += lora.write_adapter(out, buf)
        if log:
            log(
                f"LoRA adapters {'merged into the weights, and ' if merge_lora else ''}"
                f"in PEFT's format in {os.path.join(out, ADAPTER_DIR)}"
            )
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": {rename.get(n, n): files[i] for i, names in enumerate(shards) for n in names},
        }
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        files.append("model.safetensors.index.json")
    return {
        "checkpoint": tag_dir,
        "out": out,
        "files": files + copied,
        "tensors": len(sizes),
        "bytes": sum(sizes.values()),
        "dtype": ck.dtype,
        "world_size": ck.world_size,
        "copy_buffer_bytes": len(buf),
    }
