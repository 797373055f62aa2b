"""A chat conversation kept in a file, so that each ``generate`` continues it: a JSON list of messages
(``[{"role": "user", "content": "..."}, ...]``, what chat templates and the OpenAI API take) or JSON lines of them.
The reply is appended and the file replaced atomically (written beside it, fsync'd, renamed), so a run cut short
leaves the conversation as it was."""

from __future__ import annotations

import json
import os
from typing import List

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(ValueError):
    """A messages file that cannot be read as a conversation, with where and why."""


def read(path: str) -> List[dict]:
    """The messages of ``path`` (a missing file is an empty conversation)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        return []
    try:
        data = json.loads(text)
        messages = data["messages"] if isinstance(data, dict) and "messages" in data else data
    except json.JSONDecodeError:
        messages = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                messages.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConversationError(
                    f"{path} line {n} is not JSON ({e.msg}): give a JSON list of messages"
                ) from None
    if not isinstance(messages, list):
        raise ConversationError(f'{path} holds no list of messages: give [{{"role": "user", "content": TEXT}}, ...]')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ConversationError(
                f'{path}: message {i + 1} is not {{"role": one of {", ".join(ROLES)}, "content": TEXT}}: {m!r}'
            )
    return messages


def write(path: str, messages: List[dict]) -> None:
    """``messages`` as a JSON list in ``path``, replaced atomically."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(messages, f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
