// The decoder of aidaptiv/weight_codec.hpp: a 16-entry table lookup (one PSHUFB per 16 codes) and a byte
// interleave, SSSE3 where the CPU has it, the same in plain C++ otherwise and for the tails.
#include "aidaptiv/weight_codec.hpp"

#include "aidaptiv/error.hpp"

#include <ATen/Parallel.h>

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AIDAPTIV_CODEC_X86 1
#endif

namespace aidaptiv {
namespace {

// Elements [begin, end) one at a time; begin is even (a code byte holds two elements).
void decode_scalar(const uint8_t* planes, const uint8_t* codes, int64_t n, int k, const uint8_t* table, int64_t begin,
                   int64_t end, uint8_t* out) {
  for (int64_t i = begin; i < end; ++i) {
    uint8_t* o = out + i * k;
    for (int j = 0; j < k - 1; ++j) o[j] = planes[j * n + i];
    const uint8_t c = (i & 1) ? (codes[i >> 1] >> 4) : (codes[i >> 1] & 0x0F);
    o[k - 1] = table[c];
  }
}

#ifdef AIDAPTIV_CODEC_X86
// 32 elements per step: 16 code bytes -> 32 codes -> 32 top bytes through the table, interleaved with the
// planes into 2 (bf16/fp16) or 4 (fp32) bytes an element. Returns the first element it did not decode.
__attribute__((target("ssse3"))) int64_t decode_ssse3(const uint8_t* planes, const uint8_t* codes, int64_t n, int k,
                                                      const uint8_t* table, int64_t begin, int64_t end, uint8_t* out) {
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (i >> 1)));
    const __m128i even = _mm_and_si128(packed, low4);
    const __m128i odd = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    const __m128i top[2] = {_mm_shuffle_epi8(lut, _mm_unpacklo_epi8(even, odd)),
                            _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(even, odd))};
    for (int h = 0; h < 2; ++h) {
      const int64_t e = i + 16 * h;
      const __m128i p0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + e));
      uint8_t* o = out + e * k;
      if (k == 2) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi8(p0, top[h]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), _mm_unpackhi_epi8(p0, top[h]));
      } else {  // k == 4
        const __m128i p1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + n + e));
        const __m128i p2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 2 * n + e));
        const __m128i a_lo = _mm_unpacklo_epi8(p0, p1), a_hi = _mm_unpackhi_epi8(p0, p1);
        const __m128i b_lo = _mm_unpacklo_epi8(p2, top[h]), b_hi = _mm_unpackhi_epi8(p2, top[h]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi16(a_lo, b_lo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), _mm_unpackhi_epi16(a_lo, b_lo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 32), _mm_unpacklo_epi16(a_hi, b_hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 48), _mm_unpackhi_epi16(a_hi, b_hi));
      }
    }
  }
  return i;
}

bool has_ssse3() {
  static const bool yes = __builtin_cpu_supports("ssse3");
  return yes;
}
#endif

}  // namespace

void decode_weights(const uint8_t* encoded, int64_t n, int itemsize, const uint8_t* table, const int64_t* escape_positions,
                    const uint8_t* escape_values, int64_t escapes, uint8_t* out) {
  const int k = itemsize;
  const uint8_t* planes = encoded;
  const uint8_t* codes = encoded + (k - 1) * n;
  // Chunks of an even number of elements (a code byte never straddles two), large enough that a thread's
  // start-up is small beside its work.
  constexpr int64_t kGrain = int64_t(1) << 20;
  at::parallel_for(0, (n + 1) / 2, kGrain / 2, [&](int64_t pair_begin, int64_t pair_end) {
    const int64_t begin = pair_begin * 2;
    const int64_t end = pair_end * 2 < n ? pair_end * 2 : n;
    int64_t i = begin;
#ifdef AIDAPTIV_CODEC_X86
    if ((k == 2 || k == 4) && has_ssse3()) i = decode_ssse3(planes, codes, n, k, table, begin, end, out);
#endif
    decode_scalar(planes, codes, n, k, table, i, end, out);
  });
  for (int64_t e = 0; e < escapes; ++e) out[escape_positions[e] * k + (k - 1)] = escape_values[e];
}

namespace {
void expect_bytes(const torch::Tensor& t, const char* name, torch::ScalarType dtype) {
  AIDAPTIV_EXPECT(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype,
                  "decode_weights: " << name << " must be a contiguous CPU tensor of " << c10::toString(dtype)
                                     << ", got " << t.scalar_type() << " on " << t.device()
                                     << (t.is_contiguous() ? "" : " (not contiguous)"));
}
}  // namespace

void decode_weights_into(const torch::Tensor& encoded, int64_t n, int64_t itemsize, const torch::Tensor& table,
                         const torch::Tensor& escape_positions, const torch::Tensor& escape_values,
                         const torch::Tensor& out) {
  expect_bytes(encoded, "encoded", torch::kUInt8);
  expect_bytes(table, "table", torch::kUInt8);
  expect_bytes(escape_positions, "escape_positions", torch::kInt64);
  expect_bytes(escape_values, "escape_values", torch::kUInt8);
  expect_bytes(out, "out", torch::kUInt8);
  AIDAPTIV_EXPECT(n >= 0 && (itemsize == 2 || itemsize == 4 || itemsize == 8),
                  "decode_weights: n " << n << " and itemsize " << itemsize
                                       << ": n must be >= 0 and itemsize 2, 4 or 8 (floating-point elements)");
  const int64_t need = (itemsize - 1) * n + (n + 1) / 2;
  AIDAPTIV_EXPECT(encoded.numel() >= need, "decode_weights: encoded holds " << encoded.numel() << " bytes, " << n
                                                                           << " elements of " << itemsize
                                                                           << " bytes need " << need);
  AIDAPTIV_EXPECT(table.numel() == 16, "decode_weights: table holds " << table.numel() << " bytes, not 16");
  AIDAPTIV_EXPECT(out.numel() == itemsize * n, "decode_weights: out holds " << out.numel() << " bytes, " << n
                                                                           << " elements of " << itemsize
                                                                           << " bytes are " << itemsize * n);
  const int64_t escapes = escape_positions.numel();
  AIDAPTIV_EXPECT(escape_values.numel() == escapes, "decode_weights: " << escapes << " escape positions but "
                                                                       << escape_values.numel() << " values");
  const int64_t* pos = escape_positions.data_ptr<int64_t>();
  for (int64_t e = 0; e < escapes; ++e)
    AIDAPTIV_EXPECT(pos[e] >= 0 && pos[e] < n, "decode_weights: escape " << e << " is at element " << pos[e]
                                                                         << ", outside the tensor's " << n
                                                                         << ": the encoded bytes are damaged");
  decode_weights(encoded.data_ptr<uint8_t>(), n, static_cast<int>(itemsize), table.data_ptr<uint8_t>(), pos,
                 escape_values.data_ptr<uint8_t>(), escapes, out.data_ptr<uint8_t>());
}

}  // namespace aidaptiv
