"""The lossless weight codec of streamed generation (aidaptiv_ds/inference/weight_codec.py, the engine's C++
decoder): every bit comes back, whatever the values (escapes, infinities, NaNs, subnormals, odd lengths, the
SIMD body and its scalar tail); weights drawn like trained ones shrink by a quarter (bf16) or an eighth (fp32);
what would not shrink is left as it is; damaged encoded bytes are refused, not decoded into wrong weights.
In the engine's tier, so that the decoder's pointer arithmetic runs under AddressSanitizer (tests/sanitize)."""

import pytest
import torch

from aidaptiv_ds.inference.weight_codec import Codebook, codebook_for, decode_into, encode_into


def _round_trip(t: torch.Tensor) -> Codebook:
    data = t.contiguous().view(torch.uint8).reshape(-1)
    book = codebook_for(data, t.dtype)
    assert book is not None
    encoded = torch.full((book.nbytes + 13,), 0xA5, dtype=torch.uint8)  # bytes past the end stay untouched
    encode_into(data, book, encoded)
    assert torch.all(encoded[book.nbytes :] == 0xA5)
    out = torch.full_like(data, 0x5A)
    decode_into(encoded[: book.nbytes], book, out)
    assert torch.equal(out, data), f"{t.dtype} n={t.numel()}: decoded bytes differ"
    return book


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [128, 129, 1000, 4096 + 31, (1 << 20) + 3, (1 << 21) + 64])
def test_every_bit_comes_back(dtype, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    # Values whose top byte is rare: escapes, wherever they fall (SIMD body, tail, chunk edges).
    special = [float("inf"), float("-inf"), float("nan"), -0.0, 3.0e38 if dtype == torch.float32 else 1e38, 1e-39, 7.5]
    for i, v in zip(range(0, n, max(1, n // len(special))), special):
        t[i] = v
    t[-1] = -123.0
    book = _round_trip(t)
    if n >= 4096:  # in a short tensor the special values are frequent enough to have codes of their own
        assert book.escapes >= 1


@pytest.mark.parametrize("dtype,most", [(torch.bfloat16, 0.76), (torch.float32, 0.88)])
def test_weights_drawn_like_trained_ones_shrink(dtype, most):
    t = (torch.randn(512, 1024, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    book = _round_trip(t)
    assert book.nbytes <= most * t.numel() * dtype.itemsize, (book.nbytes, t.numel() * dtype.itemsize)


def test_a_constant_tensor_is_all_codes():
    book = _round_trip(torch.ones(4097))  # a norm's weight: one top byte
    assert book.escapes == 0


def test_what_would_not_shrink_is_stored_as_it_is():
    g = torch.Generator().manual_seed(1)
    spread = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)  # every top byte equally likely
    assert codebook_for(spread, torch.bfloat16) is None
    assert codebook_for(spread, torch.int16) is None  # not floating point
    assert codebook_for(spread, torch.float64) is None  # 1/16 at most: not worth a decode
    assert codebook_for(torch.zeros(64, dtype=torch.uint8), torch.float32) is None  # too small to bother


def test_damaged_or_mismatched_bytes_are_refused():
    t = (torch.randn(10_000, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    t[5] = float("inf")
    data = t.view(torch.uint8)
    book = codebook_for(data, t.dtype)
    encoded = torch.empty(book.nbytes, dtype=torch.uint8)
    encode_into(data, book, encoded)
    out = torch.empty_like(data)
    with pytest.raises(ValueError, match="out holds"):
        decode_into(encoded, book, out[:-2])
    damaged = encoded.clone()
    damaged[book.positions_at : book.positions_at + 8].view(torch.int64)[0] = 10_000  # an escape past the end
    with pytest.raises(ValueError, match="damaged"):
        decode_into(damaged, book, out)
    short = Codebook(book.n + 1000, book.itemsize, book.table, book.escapes)
    with pytest.raises(ValueError, match="encoded holds"):
        decode_into(encoded, short, torch.empty(short.n * 2, dtype=torch.uint8))
