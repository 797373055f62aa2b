"""The studio's root folder: where uploads, data sets, runs and models live, and the one gate every path from
the browser goes through (nothing outside the root is read or written).

    ROOT/uploads/   documents as uploaded (size-capped by the web server)
    ROOT/data/      data sets saved as JSONL (what `aidaptiv-ds train --data` reads)
    ROOT/runs/NAME/ one training run each (aidaptiv_ds.studio.runs)
    ROOT/models/    Hugging Face model folders the user puts there (bases to fine-tune, compare)
    ROOT/sweeps/    sweep result folders (`aidaptiv-ds sweep --out ROOT/sweeps/NAME`)
    ROOT/swap/      the default swap folder (another may be named under the root: put the root on the SSD)
    ROOT/chats/     conversations of the Chat tab (JSON lists of messages, what `generate --messages` reads)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from aidaptiv_ds.models.presets import preset_names

FOLDERS = ("uploads", "data", "runs", "models", "sweeps", "swap", "chats")
_NAME = re.compile(r"[^A-Za-z0-9._-]+")


class StudioError(Exception):
    """A request the studio refuses, with what to do instead; shown in the page as it is."""


def safe_name(name: str, what: str = "name") -> str:
    """A file or folder name from a user's string: letters, digits, '.', '_', '-' (others become '-'), never
    empty, never '.' or '..'."""
    out = _NAME.sub("-", (name or "").strip()).strip("-.")
    if not out:
        raise StudioError(f"the {what} {name!r} has no letters or digits: give one such as 'my-data'")
    return out[:100]


def has_chat_template(folder: str) -> bool:
    """Whether a model folder's tokenizer has a chat template (tokenizer_config.json or chat_template.jinja)."""
    p = Path(folder)
    if (p / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


class Workspace:
    """The folders under one root, and the check that a path stays inside it."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        for f in FOLDERS:
            (self.root / f).mkdir(parents=True, exist_ok=True)

    def __getattr__(self, folder: str) -> Path:
        # ws.data, ws.runs, ... for the folders above.
        if folder in FOLDERS:
            return self.root / folder
        raise AttributeError(folder)

    def inside(self, path: str | os.PathLike, what: str = "path") -> Path:
        """``path`` (relative: under the root) resolved, symbolic links followed; refused when it leads outside
        the root."""
        if path is None or str(path).strip() == "":
            raise StudioError(f"no {what} given")
        p = Path(str(path).strip()).expanduser()
        p = (p if p.is_absolute() else self.root / p).resolve()
        if p != self.root and self.root not in p.parents:
            raise StudioError(
                f"the {what} {path} is outside the studio's root {self.root}: the studio reads and writes only "
                "below it (start it with --root on a folder that holds what you need, or move the file there)"
            )
        return p

    def relative(self, path: Path) -> str:
        return str(Path(path).resolve().relative_to(self.root))

    def data_sets(self) -> list[str]:
        """Saved data sets, newest first, as paths relative to the root."""
        files = sorted(self.data.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True)
        return [self.relative(p) for p in files]

    def model_folders(self) -> list[str]:
        """Hugging Face folders under models/ and the runs' exported models (relative paths)."""
        found = [p.parent for p in self.models.glob("*/config.json")]
        found += [p.parent for p in self.runs.glob("*/model/config.json")]
        found += [p.parent for p in self.runs.glob("*/base/config.json")]
        return [self.relative(p) for p in sorted(set(found), key=lambda p: p.stat().st_mtime, reverse=True)]

    def model_choices(self) -> list[str]:
        """What a model dropdown offers: the presets (random weights), then the folders."""
        return preset_names() + self.model_folders()

    def model_argument(self, choice: str) -> str:
        """The --model argument of a dropdown's choice: a preset as it is, a folder as its absolute path."""
        if choice in preset_names():
            return choice
        folder = self.inside(choice, "model folder")
        if not (folder / "config.json").is_file():
            raise StudioError(f"{choice} is no Hugging Face model folder (no config.json in it)")
        return str(folder)
