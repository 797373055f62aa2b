import pytest

from aidaptiv_ds.models.presets import PRESETS, resolve
from aidaptiv_ds.models.tokenizer import ByteTokenizer, tokenizer_for


@pytest.mark.parametrize("text", ["", "hello world", "Où est la gare ? ¿Dónde?", "tabs\tand\nnewlines", "emoji 🚀"])
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.BOS and ids[-1] == tok.EOS
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert tok.decode(ids) == text


def test_specials_are_distinct_and_outside_bytes():
    tok = ByteTokenizer()
    assert {tok.BOS, tok.EOS, tok.PAD} == {256, 257, 258}
    assert tok.encode("a", add_bos=False, add_eos=False) == [97]


def test_ids_valid_for_every_preset_vocabulary():
    for name, p in PRESETS.items():
        assert p["vocab_size"] >= ByteTokenizer.vocab_size, name
    spec = resolve("micro")
    assert isinstance(tokenizer_for(spec), ByteTokenizer)
    assert spec.config.bos_token_id == ByteTokenizer.BOS and spec.config.eos_token_id == ByteTokenizer.EOS
