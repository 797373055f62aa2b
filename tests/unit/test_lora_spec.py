"""--lora spec parsing (aidaptiv_ds.lora.parse_spec): defaults, comma lists of targets, every problem at once."""
import pytest

from aidaptiv_ds.lora import QLORA_REFUSAL, parse_spec


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


def test_qlora_is_refused_with_the_reason():
    with pytest.raises(ValueError) as e:
        parse_spec("r=8,bits=4")
    assert str(e.value) == QLORA_REFUSAL and "GPU issue" in QLORA_REFUSAL
