"""More than a hundred swaps in flight at once through the swap store, byte for byte (cases.concurrent_swaps)."""

import cases


def test_128_concurrent_swaps_are_byte_equal(tmp_path):
    row = cases.concurrent_swaps(str(tmp_path), seed=1)
    assert row["injected"] >= 100
    assert not row["hang"] and not row["errors"], row
    assert row["mismatches"] == 0 and not row["data_lost"], row
