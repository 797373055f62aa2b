"""Where a model named by a user is: the one answer ``train``, ``generate``, ``export``, ``plan`` and the studio
share for ``--model``.

A model is named by a preset (random weights of a published shape, :mod:`aidaptiv_ds.models.presets`), a local
Hugging Face folder, a hub id (``Qwen/Qwen2.5-0.5B-Instruct``, resolved through huggingface_hub's cache:
:mod:`aidaptiv_ds.models.hub`), or a ``.gguf`` file (converted once into a cached folder:
:mod:`aidaptiv_ds.models.gguf`). Every form but the preset becomes a local folder with config.json, safetensors
weights and the tokenizer.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

FORMS = "a preset, a local Hugging Face folder, a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or a .gguf file"


def model_folder(model: str, log: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The local folder of ``model``, or None when it names a preset. Raises ValueError saying what is accepted."""
    from aidaptiv_ds.models import gguf, hub
    from aidaptiv_ds.models.preset_shapes import PRESETS

    if model in PRESETS:
        return None
    if os.path.isfile(model) and model.lower().endswith(".gguf"):
        return gguf.model_folder(model, log=log)
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"`model` {model} is a file but not a .gguf file: give {FORMS}")
    if hub.looks_like_hub_id(model):
        return hub.model_folder(model)
    raise ValueError(f"`model` {model!r} is not {FORMS} ({', '.join(PRESETS)} are the presets)")


def config_dict(model: str) -> dict:
    """The config of a model with weights (not a preset) as a dict, fetching or converting no weights: a
    folder's config.json, a hub id's config.json alone, a GGUF file's metadata."""
    import json

    from aidaptiv_ds.models import gguf, hub

    if os.path.isfile(model) and model.lower().endswith(".gguf"):
        return gguf.config_dict(model)
    folder = model if os.path.isdir(model) else None
    if folder is None and not os.path.exists(model) and hub.looks_like_hub_id(model):
        folder = hub.model_folder(model, config_only=True)
    if folder is None:
        from aidaptiv_ds.models.preset_shapes import PRESETS

        raise ValueError(f"`model` {model!r} is not {FORMS} ({', '.join(PRESETS)} are the presets)")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"`model` {model} is a directory without config.json: give a Hugging Face model directory or a preset"
        )
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"`model` {path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def display_name(model: str) -> str:
    """A short name for a model as given: the preset, the folder's or file's name, the hub id's model part."""
    from aidaptiv_ds.models import hub

    if hub.looks_like_hub_id(model):
        return hub.split_id(model)[0].split("/")[-1]
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base
