"""The one size parser and its documented meaning: decimal GB, binary GiB, a bare M binary (as dd and fio)."""

import pytest

from aidaptiv_ds.common import sizes
from aidaptiv_ds.config.schema import parse_budget


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4GB", 4 * 10**9),
        ("4GiB", 4 << 30),
        ("4G", 4 << 30),
        ("1M", 1 << 20),
        ("1MB", 10**6),
        ("1MiB", 1 << 20),
        ("256k", 256 << 10),
        ("256KiB", 256 << 10),
        ("2TB", 2 * 10**12),
        ("1.5GiB", int(1.5 * 2**30)),
        ("268435456", 268435456),
        (4096, 4096),
        (" 512 MiB ", 512 << 20),
        ("8b", 8),
    ],
)
def test_size_strings_mean_what_the_readme_says(text, expected):
    assert sizes.parse_size(text) == expected


@pytest.mark.parametrize("value", ["lots", "4 GB of RAM", "-1", -1, True, "1.2.3M", "25%"])
def test_what_is_not_a_size_names_the_setting(value):
    with pytest.raises(ValueError, match="block_size"):
        sizes.parse_size(value, "block_size")


def test_the_budget_reads_sizes_with_the_same_parser():
    for text in ("4GB", "4GiB", "1M", "1MB", "256k"):
        assert parse_budget(text) == (sizes.parse_size(text), None)


def test_alignment_element_size_and_state_per_parameter():
    assert sizes.ALIGN == 4096 and sizes.align_up(1) == 4096 and sizes.align_up(8192) == 8192
    assert sizes.align_up(5, 4) == 8
    assert [sizes.dtype_bytes(n) for n in ("fp32", "bf16", "fp16")] == [4, 2, 2]
    assert sizes.state_bytes_per_param() == 20 and sizes.state_bytes_per_param(2) == 18
