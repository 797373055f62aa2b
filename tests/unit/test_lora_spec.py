"""--lora spec parsing (aidaptiv_ds.job.lora.parse_spec): defaults, comma lists of targets, every problem at once."""

import pytest

from aidaptiv_ds.job.lora import parse_spec


def test_targets_run_to_the_next_key_and_alpha_defaults_to_twice_r():
    s = parse_spec("r=16,targets=q_proj,v_proj,k_proj,dropout=0.05")
    assert (s.r, s.alpha, s.targets, s.dropout) == (16, 32.0, ("q_proj", "v_proj", "k_proj"), 0.05)
    assert parse_spec("r=4,alpha=8").targets == ("q_proj", "v_proj")


def test_every_problem_is_listed():
    with pytest.raises(ValueError) as e:
        parse_spec("alpha=-1,rank=3,dropout=2")
    msg = str(e.value)
    for part in ("alpha=-1", "unknown key 'rank'", "dropout=2", "r is required"):
        assert part in msg, msg


def test_bits_4_asks_for_qlora_and_other_bits_are_refused():
    assert parse_spec("r=8,bits=4").bits == 4
    assert parse_spec("r=8").bits == 16
    assert "QLoRA" in parse_spec("r=8,bits=4").describe()
    with pytest.raises(ValueError) as e:
        parse_spec("r=8,bits=8")
    assert "bits=8 must be 4 (QLoRA), 16 or 32" in str(e.value)
