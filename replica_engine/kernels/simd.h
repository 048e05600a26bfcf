// AVX-512 loads and stores of 16 values as float32, from and to float32 or bfloat16 memory, and
// the exponential, softmax steps (16 scores, or a block at once) and 16x16 transpose the attention
// kernels use.
#pragma once
#include <ATen/core/ATen_fwd.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16_masked(const at::BFloat16* p, __mmask16 mask) {
  __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// v's 16 floats as bfloat16, each in its 32-bit lane's low half: rounded to nearest even, as
// torch converts float32 to bfloat16.
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_srli_epi32(rounded, 16);
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// The first `valid` of 16 values (all 16: one store; fewer: the last block of an N that is not a
// multiple of 16).
template <typename Out>
inline void store_first(Out* dst, __m512 v, int64_t valid) {
  if (valid == 16) {
    store16(dst, v);
    return;
  }
  alignas(64) Out tmp[16];
  store16(tmp, v);
  std::memcpy(dst, tmp, valid * sizeof(Out));
}

// v as the storage type T would hold it (bfloat16 rounding; float32 unchanged).
inline __m512 round_to(const float*, __m512 v) { return v; }
inline __m512 round_to(const at::BFloat16*, __m512 v) {
  alignas(64) at::BFloat16 tmp[16];
  store16(tmp, v);
  return load16(tmp);
}

// exp of 16 floats: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6 Taylor polynomial
// (relative error ~2e-7, about float32's rounding).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// One step of an online softmax over 16 scores (`valid` of them real): moves the row's running
// max and sum, and returns the step's probabilities (0 where not valid) and, in `correction`,
// the factor its earlier output must be rescaled by. A row that has seen nothing yet (max still
// -inf) keeps its empty state (no -inf - -inf).
inline __m512 online_softmax16(__m512 scores, __mmask16 valid, float& running_max, float& running_sum,
                               float& correction) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  scores = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid, scores);
  const float new_max = std::max(running_max, _mm512_reduce_max_ps(scores));
  correction = new_max == kNegInf ? 1.f : std::exp(running_max - new_max);
  const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
  running_sum = running_sum * correction + _mm512_reduce_add_ps(p);
  running_max = new_max;
  return p;
}

// A softmax over `count` scores at once (a block of keys), merged into a row's running max and
// sum: store(t, p) takes the probabilities of scores [16t, 16t + 16) (0 past `count`) for each
// 16-score tile that holds one. Returns the factor the row's earlier output must be rescaled by
// (1 while the row has seen nothing).
template <typename Store>
inline float block_softmax(const float* scores, int64_t count, float& running_max, float& running_sum,
                           const Store& store) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const auto valid = [&](int64_t t) {
    return static_cast<__mmask16>((1u << std::clamp<int64_t>(count - t * 16, 0, 16)) - 1);
  };
  __m512 top = _mm512_set1_ps(kNegInf);
  for (int64_t t = 0; t * 16 < count; ++t)
    top = _mm512_mask_max_ps(top, valid(t), top, _mm512_loadu_ps(scores + t * 16));
  const float new_max = std::max(running_max, _mm512_reduce_max_ps(top));
  const float correction = running_max == kNegInf ? 1.f : std::exp(running_max - new_max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t * 16 < count; ++t) {
    const __m512 shifted = _mm512_sub_ps(_mm512_loadu_ps(scores + t * 16), _mm512_set1_ps(new_max));
    const __m512 p = _mm512_maskz_mov_ps(valid(t), exp16(shifted));
    sum = _mm512_add_ps(sum, p);
    store(t, p);
  }
  running_sum = running_sum * correction + _mm512_reduce_add_ps(sum);
  running_max = new_max;
  return correction;
}

// Rows r[0..15] of 16 floats become their columns: r[i][j] <- r[j][i].
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, i+4 and i+8, i+12
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Register tiles of R rows, R a compile-time constant so that a tile's accumulators stay in registers.
template <int64_t R>
using Rows = std::integral_constant<int64_t, R>;

// fn(i0, Rows<R>) for the last `left` (< R + 1) rows from i0, as one group.
template <int64_t R, typename Fn>
inline void last_group(int64_t i0, int64_t left, const Fn& fn) {
  if constexpr (R > 0) {
    if (left == R) fn(i0, Rows<R>{});
    else last_group<R - 1>(i0, left, fn);
  }
}

// fn(i0, Rows<R>) over rows [0, n): groups of kMax, then one group of the rest.
template <int64_t kMax, typename Fn>
inline void row_groups(int64_t n, const Fn& fn) {
  int64_t i = 0;
  for (; i + kMax <= n; i += kMax) fn(i, Rows<kMax>{});
  last_group<kMax - 1>(i, n - i, fn);
}
