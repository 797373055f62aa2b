"""Data in every accepted form (aidaptiv_ds.job.record_files): JSONL, JSON, CSV, Parquet and datasets folders give
the same training texts; anything else is refused with a message listing the accepted forms."""

import csv
import json

import pytest

from aidaptiv_ds.job.data import DataError, load_texts
from aidaptiv_ds.job.record_files import ACCEPTED, form_of, read_records

RECORDS = [
    {"instruction": "Add.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "Hi."},
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
]


@pytest.fixture
def expected(tmp_path):
    path = tmp_path / "ref.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return load_texts(str(path))


def test_json_array_and_json_lines_under_json(tmp_path, expected):
    array = tmp_path / "a.json"
    array.write_text(json.dumps(RECORDS, indent=2))
    lines = tmp_path / "l.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert load_texts(str(array)) == expected == load_texts(str(lines))


def test_csv_with_empty_cells_and_a_chat_cell(tmp_path, expected):
    path = tmp_path / "d.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, ["instruction", "input", "output"])
        w.writeheader()
        w.writerows(RECORDS)
    assert load_texts(str(path)) == expected
    chat = tmp_path / "chat.csv"
    with open(chat, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        w.writerow([json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])])
        w.writerow(["[not json"])
    with pytest.raises(DataError, match=r"chat\.csv:3: the messages cell is not valid JSON"):
        load_texts(str(chat))


def test_parquet_with_nulls_and_chat_structs(tmp_path, expected):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [dict(r, input=r["input"] or None) for r in RECORDS]  # nulls where the input is empty
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_texts(str(tmp_path / "d.parquet")) == expected
    chat = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "c.parquet")
    assert load_texts(str(tmp_path / "c.parquet")) == ["### User:\nq\n\n### Assistant:\na"]


def test_datasets_folders(tmp_path, expected):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(RECORDS)
    ds.save_to_disk(str(tmp_path / "one"))
    assert form_of(str(tmp_path / "one")) == "hf_disk"
    assert load_texts(str(tmp_path / "one")) == expected
    datasets.DatasetDict(train=ds, test=ds.select([0])).save_to_disk(str(tmp_path / "dict"))
    assert load_texts(str(tmp_path / "dict")) == expected
    datasets.DatasetDict(validation=ds).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(DataError, match="splits validation and no 'train'"):
        load_texts(str(tmp_path / "no_train"))


def test_other_forms_are_refused_naming_the_accepted_ones(tmp_path):
    (tmp_path / "d.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"extension '\.txt'") as e:
        read_records(str(tmp_path / "d.txt"))
    assert ACCEPTED in str(e.value)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="not a datasets save_to_disk folder") as e:
        read_records(str(tmp_path / "folder"))
    assert ACCEPTED in str(e.value)
    with pytest.raises(DataError, match="does not exist"):
        read_records(str(tmp_path / "missing.parquet"))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match="has no records"):
        read_records(str(tmp_path / "empty.json"))


def test_a_binary_file_under_a_text_name_is_one_sentence_with_its_name(tmp_path):
    from aidaptiv_ds.job.record_files import DataError, read_records

    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n' + bytes(range(128, 256)))
    with pytest.raises(DataError, match=rf"data file {path} is not UTF-8 text \(byte 0x80"):
        read_records(str(path))
