// How cpu_quantized_linear.cpp and the embedding lookup (cpu_quantized_rows.cpp) read a weight
// kept quantized, and its values dequantized a column block or a row at a time.
//
// Layout (quantized_weight.py packs it): the same 16-column blocks as the packed float kernel.
// For block b and group g, codes hold the group's k values in pairs (2 consecutive k per column,
// 32 bytes for the 16 columns): 8-bit codes one 32-byte run per pair; 4-bit codes one run per
// two pairs, pair p in the low nibbles and pair p + 8 in the high ones (kGroup 32 only).
// Scales: 16 d then 16 m, float16, per block and group.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "simd.h"
#include "tensor.h"

namespace quantized {

constexpr int64_t kCols = 16;

template <int kBits, int64_t kGroup>
struct Format {
  static_assert((kBits == 8 && (kGroup == 16 || kGroup == 32)) || (kBits == 4 && kGroup == 32));
  static constexpr int64_t kGroupBytes = kGroup * kCols * kBits / 8;  // one block's codes per group
};

// One column block dequantized into bfloat16 in pack_linear_weight's layout ([K / 2, 16, 2]): the
// values dequantize(weight).to(torch.bfloat16) holds (code * d + m in float32, then rounded).
template <int kBits, int64_t kGroup>
inline void dequantize_block(const uint8_t* codes, const at::Half* scales, int64_t block, int64_t K,
                             at::BFloat16* out) {
  using F = Format<kBits, kGroup>;
  const int64_t groups = K / kGroup;
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m512i low_half = _mm512_set1_epi32(0xffff);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group_codes = codes + (block * groups + g) * F::kGroupBytes;
    const at::Half* s = scales + (block * groups + g) * 2 * kCols;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kCols)));
    for (int64_t p = 0; p < kGroup / 2; ++p) {
      __m256i raw;
      if constexpr (kBits == 8) {
        raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_codes + p * 32));
      } else {  // pair p in the low nibbles of run p, pair p + 8 in the high ones
        raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_codes + (p % 8) * 32));
        raw = _mm256_and_si256(p < 8 ? raw : _mm256_srli_epi16(raw, 4), nibble);
      }
      const __m512i pair = _mm512_cvtepu8_epi16(raw);  // lane c: column c's (k, k + 1) codes
      const auto value = [&](__m512i code) { return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(code), d), mins); };
      const __m512i even = bf16_bits(value(_mm512_and_si512(pair, low_half)));
      const __m512i odd = bf16_bits(value(_mm512_srli_epi32(pair, 16)));
      _mm512_storeu_si512(out + (g * kGroup / 2 + p) * 2 * kCols, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
  }
}

// Row `row` of W (a token's embedding) dequantized as dequantize_rows computes it: code * d + m in
// float32, stored as Out (bfloat16 rounded to nearest even, as torch's .to(bfloat16)).
template <int kBits, int64_t kGroup, typename Out>
inline void dequantize_row(const uint8_t* codes, const at::Half* scales, int64_t row, int64_t K, Out* out) {
  using F = Format<kBits, kGroup>;
  const int64_t groups = K / kGroup, block = row / kCols, lane = row % kCols;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group_codes = codes + (block * groups + g) * F::kGroupBytes;
    const at::Half* s = scales + (block * groups + g) * 2 * kCols;
    uint8_t values[kGroup];  // the lane's codes, k in order: pair p holds k = 2p and 2p + 1
    for (int64_t p = 0; p < kGroup / 2; ++p) {
      for (int64_t h = 0; h < 2; ++h) {
        if constexpr (kBits == 8) {
          values[2 * p + h] = group_codes[p * 32 + lane * 2 + h];
        } else {  // pair p in the low nibbles of run p, pair p + 8 in the high ones
          const uint8_t byte = group_codes[(p % 8) * 32 + lane * 2 + h];
          values[2 * p + h] = p < 8 ? byte & 0x0f : byte >> 4;
        }
      }
    }
    const __m512 d = _mm512_set1_ps(static_cast<float>(s[lane]));
    const __m512 m = _mm512_set1_ps(static_cast<float>(s[kCols + lane]));
    for (int64_t i = 0; i < kGroup; i += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + i));
      const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
      store16(out + g * kGroup + i, _mm512_add_ps(_mm512_mul_ps(code, d), m));
    }
  }
}

}  // namespace quantized
