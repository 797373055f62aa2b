"""A data set being built in the page: records as table rows (previewed, edited, dropped), saved as the JSONL
that ``aidaptiv-ds train --data`` reads, with its size and token count.

A row is ``keep, source, kind, instruction, context, response, text``: kind "text" is a passage
(``{"text"}``), "instruction" a Dolly-shaped record (``{"instruction", "context", "response"}``; Alpaca and
prompt/response records are shown in that shape), "messages" a chat whose messages are the JSON in ``text``.
Unticked ``keep`` drops the row when the set is saved.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from aidaptiv_ds.studio.workspace import StudioError

COLUMNS = ["keep", "source", "kind", "instruction", "context", "response", "text"]


def record_row(rec: dict, source: str) -> list:
    if "messages" in rec:
        return [True, source, "messages", "", "", "", json.dumps(rec["messages"], ensure_ascii=False)]
    if "instruction" in rec or "prompt" in rec:
        instruction = rec.get("instruction", rec.get("prompt", ""))
        context = rec.get("context", rec.get("input", "")) or ""
        response = rec.get("response", rec.get("output", ""))
        return [True, source, "instruction", instruction, context, response, ""]
    return [True, source, "text", "", "", "", rec.get("text", "")]


def row_record(row: list, where: str) -> dict | None:
    """The record of one table row, None when it is not kept; StudioError for a row that is no record."""
    keep, _source, kind, instruction, context, response, text = (list(row) + [""] * 7)[:7]
    if keep in (False, "false", "False", 0, "0"):
        return None
    kind = str(kind or "").strip()
    if kind == "text":
        if not str(text or "").strip():
            raise StudioError(f"{where}: a text row needs its text (or untick keep to drop it)")
        return {"text": str(text)}
    if kind == "instruction":
        if not str(instruction or "").strip() or not str(response or "").strip():
            raise StudioError(f"{where}: an instruction row needs an instruction and a response")
        return {"instruction": str(instruction), "context": str(context or ""), "response": str(response)}
    if kind == "messages":
        try:
            messages = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise StudioError(f"{where}: the messages are not JSON ({e})") from None
        return {"messages": messages}
    raise StudioError(f"{where}: kind {kind!r} is none of text, instruction, messages")


def rows_to_records(rows: list) -> list[dict]:
    """Every kept row's record, checked by the training job's own record check; every problem listed."""
    from aidaptiv_ds.job.data import format_record
    from aidaptiv_ds.job.record_files import DataError

    records, problems = [], []
    for i, row in enumerate(rows, start=1):
        try:
            rec = row_record(row, f"row {i}")
            if rec is not None:
                format_record(rec, f"row {i}")
                records.append(rec)
        except (StudioError, DataError) as e:
            problems.append(str(e))
    if problems:
        raise StudioError("the set cannot be saved: " + "; ".join(problems))
    if not records:
        raise StudioError("the set has no kept rows: add documents or records, or tick keep")
    return records


def token_counter(model: str):
    """A function text -> token count with the tokenizer ``train --model model`` would use."""
    from aidaptiv_ds.models.presets import resolve
    from aidaptiv_ds.models.tokenizer import tokenizer_for

    try:
        tok = tokenizer_for(resolve(model))
    except (ValueError, OSError) as e:
        raise StudioError(f"no tokenizer for {model}: {e}") from None
    return lambda text: len(tok.encode(text, add_bos=False, add_eos=False)), tok


def summary(records: list[dict], model: str) -> dict:
    """Records, bytes of the JSONL and tokens as the job will count them (template and BOS/EOS included)."""
    from aidaptiv_ds.job.data import record_tokens

    _, tok = token_counter(model)
    tokens = sum(len(record_tokens(rec, tok)) for rec in records)
    text = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    from collections import Counter

    kinds = dict(Counter(record_row(rec, "")[2] for rec in records))  # the table's own kind of each record
    return {"records": len(records), "bytes": len(text.encode()), "tokens": tokens, "kinds": kinds}


def save(records: list[dict], path: Path) -> Path:
    """The records as JSONL, written under a temporary name, fsync'd and renamed (never half a file)."""
    from aidaptiv_ds.common.durable import write_text_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(str(path), "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records))
    return path


def load_rows(path: Path) -> list[list]:
    """A saved set back as table rows (to edit it again)."""
    rows = []
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if line.strip():
                    rows.append(record_row(json.loads(line), os.path.basename(path)))
    except json.JSONDecodeError as e:
        raise StudioError(
            f"{os.path.basename(path)}:{number} is not a JSON record ({e.msg}): fix or remove it"
        ) from None
    except UnicodeDecodeError as e:
        raise StudioError(f"{os.path.basename(path)} is not UTF-8 (byte at offset {e.start})") from None
    return rows
