"""Reading instruction records from a data file or folder, whatever form it is stored in.

One job: turn ``--data PATH`` into a list of ``(where, record)`` pairs (``where`` names the file and line or
row, for error messages); what a record means is aidaptiv_ds.job.data's business. The form is decided by the
path alone, never guessed from the content:

- ``*.jsonl`` / ``*.ndjson``: one JSON object per line (blank lines skipped);
- ``*.json``: a JSON array of objects (Alpaca's ``alpaca_data.json``), or JSON lines like ``*.jsonl``;
- ``*.csv``: a header row naming the fields; empty cells are empty strings; a ``messages`` cell holds the
  chat as JSON text;
- ``*.parquet``: one record per row (a ``messages`` column of lists of structs is a chat);
- a folder written by ``datasets``' ``save_to_disk`` (``state.json``/``dataset_info.json``, or a
  ``dataset_dict.json`` whose ``train`` split is used).

pyarrow and datasets are imported only for the forms that need them.
"""

from __future__ import annotations

import csv
import json
import os

ACCEPTED = (
    "a JSON Lines file (.jsonl, .ndjson), a .json file (an array of records, or JSON lines), a .csv file "
    "with a header row, a .parquet file, or a folder saved by datasets' save_to_disk"
)


class DataError(ValueError):
    """A data path that cannot be read, or a malformed record; the message names the file and line or row."""


def form_of(path: str) -> str:
    """'jsonl', 'json', 'csv', 'parquet' or 'hf_disk' for ``path``; DataError if it is none of them."""
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if "dataset_dict.json" in names or {"state.json", "dataset_info.json"} & names:
            return "hf_disk"
        raise DataError(
            f"data folder {path} is not a datasets save_to_disk folder (no state.json, "
            f"dataset_info.json or dataset_dict.json): give {ACCEPTED}"
        )
    if not os.path.exists(path):
        raise DataError(f"data file {path} does not exist: give {ACCEPTED}")
    ext = os.path.splitext(path)[1].lower()
    forms = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
    if ext not in forms:
        raise DataError(
            f"data file {path} has the extension {ext or '(none)'!r}, which is not a form this "
            f"job reads: give {ACCEPTED}"
        )
    return forms[ext]


def read_records(path: str) -> list[tuple[str, object]]:
    """Every record of ``path`` as (where, record); the record is whatever the file holds (data.py checks it)."""
    form = form_of(path)
    try:
        records = {"jsonl": _jsonl, "json": _json, "csv": _csv, "parquet": _parquet, "hf_disk": _hf_disk}[form](path)
    except UnicodeDecodeError as e:  # a binary file (or another encoding) under a text form's name
        raise DataError(
            f"data file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start} of what was "
            f"read): a {form} file must be UTF-8; convert it, or give {ACCEPTED}"
        ) from None
    if not records:
        raise DataError(f"data file {path} has no records")
    return records


def _jsonl(path: str) -> list:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                out.append((where, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    return out


def _json(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.lstrip().startswith("["):
        return _jsonl(path)  # JSON lines under a .json name, as many exports write them
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    return [(f"{path} record {i}", rec) for i, rec in enumerate(items)]


def _csv(path: str) -> list:
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        for row_no, row in enumerate(csv.DictReader(f), 2):  # row 1 is the header
            where = f"{path}:{row_no}"
            rec = {k: ("" if v is None else v) for k, v in row.items() if k is not None}
            if isinstance(rec.get("messages"), str) and rec["messages"].strip():
                try:
                    rec["messages"] = json.loads(rec["messages"])
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{where}: the messages cell is not valid JSON ({e.msg}); write the chat "
                        'as a JSON list of {"role", "content"} objects'
                    ) from None
            out.append((where, rec))
    return out


def _parquet(path: str) -> list:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataError(f"data file {path} is not a readable Parquet file ({type(e).__name__}: {e})") from None
    return [(f"{path} row {i}", rec) for i, rec in enumerate(rows)]


def _hf_disk(path: str) -> list:
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(
                f"data folder {path} is a DatasetDict with splits {', '.join(ds)} and no 'train': "
                "save the split to train on alone (ds[split].save_to_disk) and give that folder"
            )
        ds = ds["train"]
    return [(f"{path} row {i}", rec) for i, rec in enumerate(ds)]
