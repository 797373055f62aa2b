import json

import pytest
import torch

from aidaptiv_ds.job.data import (
    DEFAULT_DATA,
    DataError,
    PackedStream,
    ShardedBatches,
    build_batches,
    format_record,
    load_texts,
    record_tokens,
)
from aidaptiv_ds.models.tokenizer import ByteTokenizer


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_dolly_record_with_and_without_context():
    with_ctx = format_record({"instruction": "Summarise.", "context": "A long text.", "response": "Short."})
    assert with_ctx == "### Instruction:\nSummarise.\n\n### Input:\nA long text.\n\n### Response:\nShort."
    no_ctx = format_record({"instruction": "Say hi.", "context": "", "response": "Hi."})
    assert no_ctx == "### Instruction:\nSay hi.\n\n### Response:\nHi."


def test_alpaca_record_matches_dolly_template():
    alpaca = format_record({"instruction": "Add.", "input": "2 and 3", "output": "5"})
    dolly = format_record({"instruction": "Add.", "context": "2 and 3", "response": "5"})
    assert alpaca == dolly
    assert format_record({"instruction": "Add.", "output": "5"}) == "### Instruction:\nAdd.\n\n### Response:\n5"


def test_prompt_response_record():
    assert format_record({"prompt": "Q?", "response": "A."}) == "### Instruction:\nQ?\n\n### Response:\nA."


def test_chat_messages_record():
    text = format_record(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
            ]
        }
    )
    assert text == "### System:\nBe brief.\n\n### User:\nHi\n\n### Assistant:\nHello."


def test_text_record_is_its_passage_framed_by_bos_eos_even_with_a_chat_template():
    assert format_record({"text": "Chapter 1.\nIt was cold."}) == "Chapter 1.\nIt was cold."
    tok = ByteTokenizer()
    assert record_tokens({"text": "ab"}, tok) == [tok.BOS, ord("a"), ord("b"), tok.EOS]

    class ChatTokenizer(ByteTokenizer):
        has_chat_template = True

        def encode_chat(self, messages):
            raise AssertionError("a passage must not go through the chat template")

    assert record_tokens({"text": "ab"}, ChatTokenizer()) == [tok.BOS, ord("a"), ord("b"), tok.EOS]
    # A record with instruction keys stays an instruction record, whatever else it carries.
    assert format_record({"prompt": "Q?", "response": "A.", "text": "x"}).startswith("### Instruction:")


@pytest.mark.parametrize(
    "record, fragment",
    [
        ({"instruction": "x"}, "unrecognised record"),
        ({"instruction": 3, "response": "y"}, "'instruction' must be a string"),
        ({"text": 5}, "'text' must be a string"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_records_are_explained(record, fragment):
    with pytest.raises(DataError, match=None) as e:
        format_record(record, "f.jsonl:7")
    assert "f.jsonl:7" in str(e.value) and fragment in str(e.value)


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "a", "response": "b"},
            "",
            "{not json",
        ],
    )
    with pytest.raises(DataError) as e:
        load_texts(path)
    assert f"{path}:3" in str(e.value) and "not valid JSON" in str(e.value)


def test_bad_record_line_number_counts_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}, "", "", {"foo": 1}])
    with pytest.raises(DataError, match=r"d\.jsonl:4: unrecognised record"):
        load_texts(path)


def test_mixed_formats_in_one_file_and_empty_file(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "a", "response": "b"},
            {"instruction": "c", "input": "", "output": "d"},
            {"messages": [{"role": "user", "content": "e"}]},
        ],
    )
    assert len(load_texts(path)) == 3
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="has no records"):
        load_texts(str(empty))
    with pytest.raises(DataError, match="does not exist"):
        load_texts(str(tmp_path / "missing.jsonl"))


def test_packaged_data_set_loads_and_is_small():
    texts = load_texts(DEFAULT_DATA)
    assert 100 <= len(texts) <= 300
    assert len(set(texts)) == len(texts), "duplicate records in the packaged set"
    assert sum(len(t) for t in texts) < 500_000


def test_packing_covers_every_token_in_order_then_reshuffles():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    stream = PackedStream(docs, seq_len=4, seed=0)
    assert stream.epoch_tokens == 10
    first_epoch = torch.cat([stream.sequence(k) for k in range(3)])[:10].tolist()
    # One epoch holds every document exactly once, each contiguous.
    assert sorted(first_epoch) == list(range(1, 11))
    for d in docs:
        s = first_epoch.index(d[0])
        assert first_epoch[s : s + len(d)] == d
    # Sequences are exactly seq_len long, int64, and run on into the next epoch without a gap.
    seqs = [stream.sequence(k) for k in range(10)]
    assert all(s.shape == (4,) and s.dtype == torch.int64 for s in seqs)
    flat = torch.cat(seqs).tolist()
    assert sorted(flat[10:20]) == list(range(1, 11))


def test_packing_is_deterministic_per_seed():
    docs = [[i] * (i + 1) for i in range(30)]
    a = [PackedStream(docs, 8, seed=1).sequence(k).tolist() for k in range(20)]
    b = [PackedStream(docs, 8, seed=1).sequence(k).tolist() for k in range(20)]
    c = [PackedStream(docs, 8, seed=2).sequence(k).tolist() for k in range(20)]
    assert a == b
    assert a != c


def test_sequence_longer_than_an_epoch():
    stream = PackedStream([[1, 2, 3]], seq_len=10, seed=0)
    assert stream.sequence(0).tolist() == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]


def test_shards_interleave_and_match_one_rank_with_double_batch():
    docs = [list(range(i * 10, i * 10 + 7)) for i in range(20)]
    stream = PackedStream(docs, seq_len=5, seed=3)
    one = ShardedBatches(stream, micro_batch=4, rank=0, world_size=1)
    r0 = ShardedBatches(stream, micro_batch=2, rank=0, world_size=2)
    r1 = ShardedBatches(stream, micro_batch=2, rank=1, world_size=2)
    for m in range(3):
        both = torch.cat([r0.batch(m)["input_ids"], r1.batch(m)["input_ids"]])
        assert torch.equal(both, one.batch(m)["input_ids"])
        assert not torch.equal(r0.batch(m)["input_ids"], r1.batch(m)["input_ids"])
    b = r0.batch(0)
    assert b["input_ids"].shape == (2, 5) and torch.equal(b["labels"], b["input_ids"])
    assert b["labels"] is not b["input_ids"]


def test_bad_packing_arguments():
    with pytest.raises(ValueError, match="seq_len 1"):
        PackedStream([[1, 2]], seq_len=1, seed=0)
    stream = PackedStream([[1, 2]], seq_len=2, seed=0)
    with pytest.raises(ValueError, match="micro_batch"):
        ShardedBatches(stream, micro_batch=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2"):
        ShardedBatches(stream, micro_batch=1, rank=2, world_size=2)


def test_build_batches_from_packaged_data():
    batches = build_batches(DEFAULT_DATA, ByteTokenizer(), seq_len=64, micro_batch=2, seed=1, rank=0, world_size=1)
    ids = batches.batch(0)["input_ids"]
    assert ids.shape == (2, 64)
    assert int(ids.max()) < ByteTokenizer.vocab_size
    assert (ids == ByteTokenizer.BOS).any()
