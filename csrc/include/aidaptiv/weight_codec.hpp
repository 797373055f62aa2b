// Lossless weight codec for streamed inference: the top byte of every floating-point element (sign and the
// exponent's seven high bits) takes few values in a model's weights (2.7 bits of entropy in bf16 and fp32
// tensors drawn like trained ones), so it is stored as a 4-bit code into a table of the tensor's 15 most
// frequent top bytes, code 15 meaning "an escape": the byte is in an escape list beside the codes. The other
// bytes of each element are stored as they are, one plane per byte position. bf16 weights take 12 bits, fp32
// 28 bits, and every bit comes back: generation from the decoded weights is bit-identical.
//
// A tensor of n elements of `itemsize` bytes, encoded (aidaptiv_ds/inference/weight_codec.py writes it):
//   planes  (itemsize - 1) * n bytes   plane j holds byte j of every element (little-endian order)
//   codes   ceil(n / 2) bytes          element 2i's code in the low nibble of byte i, element 2i+1's in the high
// and, when some top bytes are escapes, the list (escape_positions: int64 element indices; escape_values: the
// top bytes) in the same encoded group, after the codes.
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>

namespace aidaptiv {

// Rebuild n elements of `itemsize` bytes into `out` (itemsize * n bytes) from `encoded` (planes then codes, as
// above), `table` (16 bytes; entry 15 is unused) and `escapes` escape entries. Uses every thread torch's
// intra-op pool has (the compute that follows is waiting for these bytes anyway).
void decode_weights(const uint8_t* encoded, int64_t n, int itemsize, const uint8_t* table, const int64_t* escape_positions,
                    const uint8_t* escape_values, int64_t escapes, uint8_t* out);

// The same on tensors, every size and dtype checked first (InvalidArgument naming what is wrong): `encoded` uint8
// of at least (itemsize - 1) * n + ceil(n / 2) bytes, `table` 16 uint8, `escape_positions` int64 and
// `escape_values` uint8 of one length (each position below n), `out` uint8 of itemsize * n bytes; all
// contiguous CPU tensors.
void decode_weights_into(const torch::Tensor& encoded, int64_t n, int64_t itemsize, const torch::Tensor& table,
                         const torch::Tensor& escape_positions, const torch::Tensor& escape_values,
                         const torch::Tensor& out);

}  // namespace aidaptiv
