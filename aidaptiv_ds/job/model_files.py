"""What a Hugging Face model folder holds besides its weights: the model's config and the tokenizer files,
written for a preset or a local model (:func:`save_model_files`) or copied from a checkpoint's or a model's
folder (:func:`copy_model_files`). The train job saves them with each tag (in the folder
:data:`aidaptiv_ds.swap.checkpoint_format.MODEL_FILES` names), and export puts them beside the weights it
writes."""

from __future__ import annotations

import os
from typing import List, Optional

from aidaptiv_ds.models.tokenizer import ByteTokenizer, save_byte_tokenizer


def copy_model_files(src: str, out: str) -> List[str]:
    """config.json, generation config and tokenizer files of ``src`` (a checkpoint tag's hf/ folder, which the
    train job writes) into ``out``; weights are not copied. Returns the names copied. A symbolic link there is
    refused (ValueError): the job never writes one, and following it would copy whatever file it names (a
    system file, another user's) into the exported model."""
    copied = []
    for f in sorted(os.listdir(src)):
        path = os.path.join(src, f)
        if os.path.islink(path):
            raise ValueError(
                f"{path} is a symbolic link (to {os.readlink(path)}): aidaptiv-ds never writes one into a "
                "checkpoint, so it was added after the save; remove it, or export with `model` naming the model's "
                "own folder or preset"
            )
        # adapter_config.json stays out: beside the weights it would make transformers load them as an adapter
        if (
            f.endswith((".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5"))
            or f.endswith(".index.json")
            or f == "adapter_config.json"
            or not os.path.isfile(path)
        ):
            continue
        _copy_no_follow(path, os.path.join(out, f))
        copied.append(f)
    return copied


def _copy_no_follow(src: str, dst: str) -> None:
    """Copy a regular file, refusing to follow a link at either end (O_NOFOLLOW)."""
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            while True:
                block = os.read(fin, 64 << 10)
                if not block:
                    break
                view = memoryview(block)
                while view:
                    view = view[os.write(fout, view) :]
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def save_model_files(spec, tokenizer, folder: str, dtype: Optional[str] = None) -> None:
    """Write what ``from_pretrained`` needs besides the weights: the model's config (with the weights' dtype,
    e.g. "bfloat16", so that ``dtype="auto"`` loads them as trained), its generation config (the model's own, or
    one made from the config for a preset) and, for a local HF model, its tokenizer
    files, or for presets the byte tokenizer in Hugging Face form (:func:`save_byte_tokenizer`)."""
    import copy

    os.makedirs(folder, exist_ok=True)
    config = copy.deepcopy(spec.config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(folder)
    # The model's generation config (its end-of-turn ids, sampling defaults) goes with it: without it, an
    # exported Llama 3 instruct model would not stop at <|eot_id|> in transformers or in `generate`.
    source = os.path.join(spec.hf_dir, "generation_config.json") if spec.hf_dir else None
    if source and os.path.isfile(source):
        _copy_no_follow(source, os.path.join(folder, "generation_config.json"))
    else:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(folder)
    hf_tok = getattr(tokenizer, "_tok", None)
    if hf_tok is not None:
        hf_tok.save_pretrained(folder)
    elif isinstance(tokenizer, ByteTokenizer):
        save_byte_tokenizer(folder)
