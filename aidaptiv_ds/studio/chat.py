"""A conversation with one model in the page: each turn is one ``aidaptiv-ds generate --messages FILE`` process
that reads the conversation so far from ROOT/chats/NAME.json, streams the reply as it prints it, and appends it
to the file (so the conversation outlives the page, and the command line can continue it). An instruct model
is asked through its chat template; the process lays out the model's weights for each turn (streamed when
they do not fit the budget), so a turn costs a lay-out plus the reply."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

from aidaptiv_ds.studio import children
from aidaptiv_ds.studio.workspace import StudioError, has_chat_template


def history(path: Path) -> list[dict]:
    """The conversation in ``path`` (none yet: empty)."""
    if not path.exists():
        return []
    try:
        messages = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StudioError(f"the conversation {path.name} cannot be read ({e}): start a new one") from None
    return messages if isinstance(messages, list) else []


def turn(
    model: str,
    path: Path,
    message: str,
    max_new_tokens: int = 128,
    host_budget: str | None = None,
    nvme_path: str | None = None,
) -> Iterator[list[dict]]:
    """Add the user's ``message`` to the conversation in ``path`` and yield the conversation as the reply grows;
    the file holds the reply once the process ends."""
    if not message.strip():
        raise StudioError("type a message first")
    if not has_chat_template(model):
        raise StudioError(
            f"{Path(model).name} has no chat template (a base model, or a preset): chat with an instruct model, "
            "or compare prompts in the Compare tab"
        )
    messages = history(path) + [{"role": "user", "content": message}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(messages, ensure_ascii=False, indent=1), encoding="utf-8")
    argv = [sys.executable, "-m", "aidaptiv_ds", "generate", "--model", model, "--messages", str(path)]
    argv += ["--max-new-tokens", str(int(max_new_tokens)), "--quiet"]
    if host_budget:
        argv += ["--host-budget", host_budget]
    if nvme_path:
        argv += ["--nvme-path", nvme_path]
    proc = children.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    reply = ""
    try:
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := proc.stdout.read1(4096):
            reply += decoder.decode(chunk)
            yield messages + [{"role": "assistant", "content": reply.strip()}]
        proc.wait()
    finally:
        if proc.poll() is None:  # the page went away mid-reply: the process goes too
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    if proc.returncode != 0:
        said = b"".join(err).decode("utf-8", errors="replace").strip().splitlines()[-3:]
        raise StudioError(f"aidaptiv-ds generate failed (exit {proc.returncode}): {' '.join(said)}")
    yield history(path)
