"""Question/answer records from passages, written by a local model the user picks, through ``aidaptiv-ds
generate`` processes over all passages (weights streamed when the model does not fit the budget). An instruct
model (one with a chat template) is asked in two rounds through its template: a question each passage answers,
then that question's answer from the passage (asked for both at once, SmolLM2-135M-Instruct wrote the question
and stopped at "Answer:"). A base model continues one prompt that asks for both.

A completion that does not hold both a question and an answer is left out and counted, never guessed at. An
answer whose content words are mostly not in its passage is marked ungrounded (``grounded`` False): a small
model invents answers, and the page leaves such records unticked for the user to read before keeping them.
The records are the question and the answer alone (no passage as context): trained on them, a model answers
such questions without the document at hand, which is what fine-tuning on documents is for; the passages
themselves stay in the set as text records.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from aidaptiv_ds.studio import children
from aidaptiv_ds.studio.workspace import StudioError, has_chat_template

PROMPT = (
    "Read the passage and write one question that it answers, then the answer, in this form:\n"
    "Question: <the question>\nAnswer: <the answer>\n\nPassage:\n{passage}\n\nQuestion:"
)
ASK_QUESTION = (
    "Read the passage below and write one question that the passage answers. Write only the question.\n\n"
    "Passage:\n{passage}"
)
ASK_ANSWER = "Answer the question using only the passage below, in one short sentence.\n\nPassage:\n{passage}\n\nQuestion: {question}"
# The answer ends at a blank line or at the next "Label:" line the model goes on with (Question:, Passage:,
# Explanation:, ...), or at the end of the text.
_QA = re.compile(
    r"^\s*(?:Question:\s*)?(?P<q>.+?)\s*\n\s*Answer:\s*(?P<a>.+?)\s*(?P<end>\n\s*\n|\n\s*[A-Z][A-Za-z ]{0,24}:|\Z)",
    re.DOTALL,
)
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'-]*")
_COMMON = frozenset(
    "the a an and or of to in on at by for with from is are was were be been it its this that these those as "
    "which who what when where why how do does did not no yes".split()
)
GROUNDED_SHARE = 0.6  # of an answer's content words, at least this share must be in its passage
# What `aidaptiv-ds generate` prints on stdout before each prompt's text when it runs several one at a time.
PROMPT_MARK = re.compile(r"^--- prompt (\d+)/(\d+) ---$", re.M)


def parse(completion: str, cut: bool = False) -> tuple[str, str] | None:
    """(question, answer) from a completion that continues after 'Question:' (or a chat reply that starts with
    it); None when either is missing, or when the answer runs to the end of a completion that was ``cut`` at its
    token limit (it may be half)."""
    m = _QA.match(completion or "")
    if not m or (cut and not m.group("end")):
        return None
    q, a = m.group("q").strip(), m.group("a").strip()
    return (q, a) if q and a else None


def content_words(text: str) -> list[str]:
    return [w for w in (x.lower() for x in _WORD.findall(text)) if w not in _COMMON]


def grounded(answer: str, passage: str) -> bool:
    """Whether most of the answer's content words (GROUNDED_SHARE) appear in the passage."""
    words = content_words(answer)
    if not words:
        return False
    seen = set(content_words(passage))
    return sum(w in seen for w in words) / len(words) >= GROUNDED_SHARE


def _generate(prompts: list, model: str, max_new_tokens: int, host_budget, nvme_path, timeout_s: float):
    """One ``aidaptiv-ds generate`` process over ``prompts`` (texts, or chat messages); yields the number of prompts
    completed as they complete, then the results (``--metrics-out``'s) as a list."""
    with tempfile.TemporaryDirectory(prefix="aidaptiv-studio-qa-") as tmp:
        path, metrics = Path(tmp) / "prompts.jsonl", Path(tmp) / "out.json"
        with open(path, "w", encoding="utf-8") as f:
            for p in prompts:
                f.write(json.dumps({"messages": p} if isinstance(p, list) else {"prompt": p}) + "\n")
        argv = [sys.executable, "-m", "aidaptiv_ds", "generate", "--model", model, "--prompts", str(path)]
        # one prompt at a time: each prompt's text comes as it is written, so the page can count them
        argv += ["--max-new-tokens", str(max_new_tokens), "--metrics-out", str(metrics), "--quiet", "--batch-size", "1"]
        if host_budget:
            argv += ["--host-budget", host_budget]
        if nvme_path:
            argv += ["--nvme-path", nvme_path]
        proc = children.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            done, seen = 0, ""
            for line in proc.stdout:
                seen += line
                marks = PROMPT_MARK.findall(seen)
                if marks and int(marks[-1][0]) - 1 > done:
                    done = int(marks[-1][0]) - 1  # the previous prompts are complete
                    yield done
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise StudioError(f"writing questions took over {timeout_s:.0f} s and was stopped") from None
        finally:
            if proc.poll() is None:  # stopped, or the page went away: no orphaned generate
                proc.kill()
                proc.wait()
        tail = "\n".join(proc.stderr.read().strip().splitlines()[-6:])
        if proc.returncode != 0:
            raise StudioError(f"aidaptiv-ds generate failed (exit {proc.returncode}): {tail}")
        yield json.loads(metrics.read_text())["results"]


def first_question(text: str) -> str | None:
    """The question of a reply asked for one: its first line, without a "Question:" label; None without one."""
    for line in (text or "").splitlines():
        line = line.strip().removeprefix("Question:").strip()
        if line:
            return line if line.endswith("?") else None
    return None


def generate_records(
    model: str,
    passages: list[str],
    *,
    max_new_tokens: int = 128,
    host_budget: str | None = None,
    nvme_path: str | None = None,
    timeout_s: float = 3600,
) -> Iterator[tuple[int, list[dict], int]]:
    """Yields (steps done, records, completions left out): progress while the model writes (a step is one
    prompt: a passage's question, then its answer), then the result, with steps done = 2 x passages (chat) or
    passages. The records are ``{"instruction", "response", "grounded"}``."""
    if not passages:
        raise StudioError("no passages to write questions for: add a document first")
    run = dict(model=model, host_budget=host_budget, nvme_path=nvme_path, timeout_s=timeout_s)
    if not has_chat_template(model):
        for step in _generate([PROMPT.format(passage=p) for p in passages], max_new_tokens=max_new_tokens, **run):
            if isinstance(step, int):
                yield step, [], 0
        pairs = [parse(r.get("text", ""), cut=r.get("new_tokens", 0) >= max_new_tokens) for r in step]
    else:
        asked = [[{"role": "user", "content": ASK_QUESTION.format(passage=p)}] for p in passages]
        for step in _generate(asked, max_new_tokens=48, **run):
            if isinstance(step, int):
                yield step, [], 0
        questions = [first_question(r.get("text", "")) for r in step]
        todo = [(i, q) for i, q in enumerate(questions) if q]
        answers = {}
        if todo:
            ask = [[{"role": "user", "content": ASK_ANSWER.format(passage=passages[i], question=q)}] for i, q in todo]
            for step in _generate(ask, max_new_tokens=max_new_tokens, **run):
                if isinstance(step, int):
                    yield len(passages) + step, [], 0
            for (i, _), r in zip(todo, step):
                cut = r.get("new_tokens", 0) >= max_new_tokens
                text = (r.get("text") or "").strip().split("\n\n")[0].strip()
                answers[i] = text if text and not cut else None
        pairs = [(q, answers[i]) if q and answers.get(i) else None for i, q in enumerate(questions)]
    records = [
        {"instruction": qa[0], "response": qa[1], "grounded": grounded(qa[1], p)}
        for qa, p in zip(pairs, passages)
        if qa is not None
    ]
    yield (2 if has_chat_template(model) else 1) * len(passages), records, len(passages) - len(records)
