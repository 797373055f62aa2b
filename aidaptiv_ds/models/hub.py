"""A Hugging Face hub id (``Qwen/Qwen2.5-7B-Instruct``, optionally ``@revision``) as a local model folder, through
huggingface_hub and its cache: what is cached is used without the network; what is not is downloaded (config,
weights in safetensors, tokenizer files, chat template), unless the hub is off (``HF_HUB_OFFLINE=1``) or
unreachable, which is said in one sentence with what to do. ``HF_HOME`` / ``HF_HUB_CACHE`` choose the cache, as
for every Hugging Face tool."""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

# What a model folder needs; pickled weights (*.bin, *.pt) are never fetched (this product reads safetensors).
FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class HubError(ValueError):
    """A hub id that cannot be had here, with what to do about it."""


def looks_like_hub_id(text: str) -> bool:
    """``org/name`` (with an optional ``@revision``) that is not a path on this machine."""
    return bool(_ID.match(text)) and not os.path.exists(text) and not text.startswith((".", "/"))


def split_id(text: str) -> Tuple[str, Optional[str]]:
    repo, _, revision = text.partition("@")
    return repo, revision or None


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def model_folder(hub_id: str, config_only: bool = False) -> str:
    """The local snapshot folder of ``hub_id``: from the cache when it is there, else downloaded. With
    ``config_only`` just its config.json is needed (what ``plan`` reads)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise HubError(
            f"model {hub_id!r} is a hub id, and huggingface_hub is not installed: pip install huggingface_hub"
        )
    repo, revision = split_id(hub_id)
    files = ["config.json"] if config_only else FILES
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=files, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    from huggingface_hub import constants

    where = f"the Hugging Face cache ({cache_dir()})"
    if constants.HF_HUB_OFFLINE:
        raise HubError(
            f"model {hub_id!r} is not in {where} and HF_HUB_OFFLINE is set: download it where the hub can be reached "
            f"(hf download {repo}) and copy the cache here (HF_HOME), or give a local model folder"
        )
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=files)
    except Exception as e:  # noqa: BLE001 - network, authentication, a missing repo: all end in one sentence
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HubError(
            f"model {hub_id!r} is not in {where} and could not be downloaded ({type(e).__name__}: {first}): check the "
            f"id and the network (a gated model needs `hf auth login`), or download it elsewhere (hf download {repo}) "
            "and copy the cache here, or give a local model folder"
        ) from None
