"""Lossless encoding of the weights generation streams from the swap file: fewer bytes a token to read.

Streaming generation is disk-bound: every token reads every streamed layer. In a model's weights the top byte of
each bf16 or fp32 element (its sign and the exponent's seven high bits) takes few values: weights drawn like
trained ones (normal, std 0.02) have 2.7 bits of entropy there and their 15 most frequent top bytes cover all
but about 0.02% of the elements. So each top byte is stored as a 4-bit code into a table of the tensor's 15
most frequent ones (code 15: an escape, the byte kept in a list beside the codes) and the other bytes as they
are, one plane per byte position. bf16 weights take 12 bits, fp32 weights 28, and decoding gives back every bit
(generation is bit-identical). The decoder is the engine's C++ (``csrc/src/weight_codec.cpp``: a table lookup
per 16 codes and a byte interleave, on torch's intra-op threads), fast enough to hide behind the next layer's
read.

A tensor's encoded bytes (``encoded_nbytes``):

    planes    (itemsize - 1) * n     plane j: byte j of every element
    codes     ceil(n / 2)            two 4-bit codes a byte, the even element's in the low nibble
    (pad to 8)
    positions 8 * escapes            int64 element index of each escape
    values    escapes                the escaped top bytes

A tensor is encoded only when that saves at least a twentieth of its bytes (a floating-point dtype of 2 or 4
bytes whose top bytes are concentrated enough); otherwise it is stored as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from aidaptiv_ds.engine import _C

ESCAPE = 15
_CHUNK = 1 << 20  # elements encoded at a time: bounds the temporaries of the lookup (a few MiB)
_MIN_SAVING = 0.05


@dataclass(frozen=True)
class Codebook:
    """How one tensor is encoded: its element count and size, the table of its 15 most frequent top bytes (16
    bytes, the last unused) and how many of its elements are escapes."""

    n: int
    itemsize: int
    table: torch.Tensor
    escapes: int

    @property
    def codes_end(self) -> int:
        return (self.itemsize - 1) * self.n + (self.n + 1) // 2

    @property
    def positions_at(self) -> int:
        return (self.codes_end + 7) // 8 * 8

    @property
    def nbytes(self) -> int:
        return self.positions_at + 9 * self.escapes


def encoded_nbytes(book: Optional[Codebook], raw_nbytes: int) -> int:
    """Bytes the tensor takes in the swap file: encoded, or as it is without a codebook."""
    return raw_nbytes if book is None else book.nbytes


def _top_bytes(flat: torch.Tensor, itemsize: int, start: int, stop: int) -> torch.Tensor:
    return flat[start * itemsize + itemsize - 1 : stop * itemsize : itemsize]


def codebook_for(data: torch.Tensor, dtype: torch.dtype) -> Optional[Codebook]:
    """The codebook of a tensor whose bytes are ``data`` (uint8, elements of ``dtype``), or None when encoding
    would not save a twentieth of them (not a 2- or 4-byte floating-point dtype, or top bytes too spread)."""
    itemsize = dtype.itemsize
    if not dtype.is_floating_point or itemsize not in (2, 4) or data.numel() < 64 * itemsize:
        return None
    n = data.numel() // itemsize
    counts = torch.zeros(256, dtype=torch.int64)
    for start in range(0, n, _CHUNK):
        counts += torch.bincount(_top_bytes(data, itemsize, start, min(n, start + _CHUNK)), minlength=256)
    # The 15 most frequent, ties to the smaller byte (a stable order, so the same bytes give the same table).
    order = sorted(range(256), key=lambda b: (-int(counts[b]), b))[:ESCAPE]
    escapes = n - int(counts[order].sum())
    table = torch.zeros(16, dtype=torch.uint8)
    table[:ESCAPE] = torch.tensor(order, dtype=torch.uint8)
    book = Codebook(n, itemsize, table, escapes)
    if book.nbytes > (1 - _MIN_SAVING) * n * itemsize:
        return None
    return book


def encode_into(data: torch.Tensor, book: Codebook, out: torch.Tensor) -> None:
    """Encode ``data`` (uint8, the tensor's bytes) into ``out`` (uint8, at least ``book.nbytes``)."""
    n, k = book.n, book.itemsize
    elements = data.view(n, k)
    for j in range(k - 1):
        out[j * n : (j + 1) * n].copy_(elements[:, j])
    lookup = torch.full((256,), ESCAPE, dtype=torch.uint8)
    lookup[book.table[:ESCAPE].to(torch.int64)] = torch.arange(ESCAPE, dtype=torch.uint8)
    codes_at = (k - 1) * n
    positions = out[book.positions_at : book.positions_at + 8 * book.escapes].view(torch.int64)
    values = out[book.positions_at + 8 * book.escapes : book.nbytes]
    found = 0
    for start in range(0, n, _CHUNK):  # _CHUNK is even: a code byte never straddles two chunks
        stop = min(n, start + _CHUNK)
        top = _top_bytes(data, k, start, stop)
        codes = lookup[top.to(torch.int32)]
        if (stop - start) % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        out[codes_at + start // 2 : codes_at + (stop + 1) // 2].copy_(codes[0::2] | (codes[1::2] << 4))
        where = (codes[: stop - start] == ESCAPE).nonzero().view(-1)
        positions[found : found + where.numel()].copy_(where + start)
        values[found : found + where.numel()].copy_(top[where])
        found += where.numel()
    assert found == book.escapes, f"{found} escapes found, the codebook counted {book.escapes}"
    out[book.codes_end : book.positions_at].zero_()


def decode_into(encoded: torch.Tensor, book: Codebook, out: torch.Tensor) -> None:
    """Rebuild the tensor's bytes into ``out`` (uint8, n * itemsize) from ``encoded`` (its ``book.nbytes``)."""
    if encoded.numel() < book.nbytes:
        raise ValueError(f"decode_weights: encoded holds {encoded.numel()} bytes, its codebook needs {book.nbytes}")
    positions = encoded[book.positions_at : book.positions_at + 8 * book.escapes].view(torch.int64)
    values = encoded[book.positions_at + 8 * book.escapes : book.nbytes]
    _C.decode_weights(encoded[: book.codes_end], book.n, book.itemsize, book.table, positions, values, out)
