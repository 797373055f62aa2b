"""Question/answer records from passages, written by a local model the user picks: one
``aidaptiv-ds generate`` process over all passages (weights streamed when the model does not fit the
budget), each prompted to write one question the passage answers and its answer. A completion that does not
hold both a question and an answer is left out and counted, never guessed at.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from aidaptiv_ds.studio.workspace import StudioError

PROMPT = (
    "Read the passage and write one question that it answers, then the answer, in this form:\n"
    "Question: <the question>\nAnswer: <the answer>\n\nPassage:\n{passage}\n\nQuestion:"
)
# The answer ends at a blank line or at the next "Label:" line the model goes on with (Question:, Passage:,
# Explanation:, ...), or at the end of the text.
_QA = re.compile(
    r"^\s*(?P<q>.+?)\s*\n\s*Answer:\s*(?P<a>.+?)\s*(?P<end>\n\s*\n|\n\s*[A-Z][A-Za-z ]{0,24}:|\Z)", re.DOTALL
)


def parse(completion: str, cut: bool = False) -> tuple[str, str] | None:
    """(question, answer) from a completion that continues after 'Question:'; None when either is missing, or
    when the answer runs to the end of a completion that was ``cut`` at its token limit (it may be half)."""
    m = _QA.match(completion or "")
    if not m or (cut and not m.group("end")):
        return None
    q, a = m.group("q").strip(), m.group("a").strip()
    return (q, a) if q and a else None


def generate_records(
    model: str,
    passages: list[str],
    *,
    max_new_tokens: int = 128,
    host_budget: str | None = None,
    nvme_path: str | None = None,
    timeout_s: float = 3600,
) -> tuple[list[dict], int, str]:
    """(records, completions left out, the process's last stderr lines) for ``passages``; the records are Dolly
    shaped: the question, the passage as context, the answer."""
    if not passages:
        raise StudioError("no passages to write questions for: add a document first")
    with tempfile.TemporaryDirectory(prefix="aidaptiv-studio-qa-") as tmp:
        prompts, metrics = Path(tmp) / "prompts.jsonl", Path(tmp) / "out.json"
        prompts.write_text("".join(json.dumps({"prompt": PROMPT.format(passage=p)}) + "\n" for p in passages))
        argv = [sys.executable, "-m", "aidaptiv_ds", "generate", "--model", model, "--prompts", str(prompts)]
        argv += ["--max-new-tokens", str(max_new_tokens), "--metrics-out", str(metrics), "--quiet"]
        if host_budget:
            argv += ["--host-budget", host_budget]
        if nvme_path:
            argv += ["--nvme-path", nvme_path]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise StudioError(f"writing questions took over {timeout_s:.0f} s and was stopped") from None
        tail = "\n".join(done.stderr.strip().splitlines()[-6:])
        if done.returncode != 0:
            raise StudioError(f"aidaptiv-ds generate failed (exit {done.returncode}): {tail}")
        results = json.loads(metrics.read_text())["results"]
    records, skipped = [], 0
    for passage, result in zip(passages, results):
        qa = parse(result.get("text", ""), cut=result.get("new_tokens", 0) >= max_new_tokens)
        if qa is None:
            skipped += 1
            continue
        records.append({"instruction": qa[0], "context": passage, "response": qa[1]})
    return records, skipped, tail
