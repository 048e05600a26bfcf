// Linear layers over weights kept quantized (GGUF's Q4_0/Q4_1/Q4_K/Q8_0/Q6_K, or int8): the
// codes are widened to 16-bit integers in registers and meet x, quantized to int16 per 32 k (one
// float scale each), in the CPU's int16 dot product (AVX512-VNNI: 2 products summed per 32-bit
// lane). A weight is code * d + m per (column, group of k); per group,
// sum(w * x) = d * dx * sum(code * xq) + m * dx * sum(xq).
// Why int16 and not llama.cpp's int8 activations (twice the products per instruction): int8
// rounding moved near-tied logits enough to change greedy answers of the embedded model
// (llama.cpp's Q4_1 answers "What is the capital of France?" with "L'Etoile, ..." as our int8
// path did); at 16 bits outputs follow the dequantized weights' in float.
//
// The weights' layout: cpu_quantized_format.h.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_linear.h"
#include "cpu_moe.h"
#include "cpu_pointwise.h"
#include "cpu_quantized_format.h"
#include "parallel.h"
#include "simd.h"
#include "tensor.h"

namespace {

using quantized::dequantize_block;
using quantized::Format;
using quantized::kCols;

constexpr int64_t kActGroup = 32;  // activations: one int16 scale per 32 k
constexpr int64_t kSumGroup = 16;  // and the sum of their codes per 16 k (the smallest weight group)
constexpr float kActMax = 32767.f;
constexpr int64_t kAhead = 4;

// x's rows as int16, a scale per 32 k, and scale * sum(codes) per 16 k.
struct QuantizedRows {
  std::vector<int16_t> codes;
  std::vector<float> scales, scaled_sums;
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K) {
  QuantizedRows rows{std::vector<int16_t>(M * K), std::vector<float>(M * K / kActGroup),
                     std::vector<float>(M * K / kSumGroup)};
  parallel_chunks(M, 16, [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) {
      for (int64_t g = 0; g < K / kActGroup; ++g) {
        const int64_t k0 = m * K + g * kActGroup;
        const __m512 a = load16(x + k0), b = load16(x + k0 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float scale = amax / kActMax, inverse = amax > 0 ? kActMax / amax : 0.f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows.codes.data() + k0), _mm512_cvtepi32_epi16(qa));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows.codes.data() + k0 + 16), _mm512_cvtepi32_epi16(qb));
        rows.scales[k0 / kActGroup] = scale;
        rows.scaled_sums[k0 / kSumGroup] = scale * _mm512_reduce_add_epi32(qa);
        rows.scaled_sums[k0 / kSumGroup + 1] = scale * _mm512_reduce_add_epi32(qb);
      }
    }
  });
  return rows;
}

// acc + the products of each 32-bit lane's two int16 pairs, summed (codes <= 255 times |x| <=
// 32767, 32 of them per group: far from overflow).
inline __m512i dot_i16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// y[m0 : m0 + kM, the kNB blocks from block0] for one run of rows and column blocks.
template <int kBits, int64_t kGroup, int64_t kM, int64_t kNB, typename Out>
void micro_kernel(const QuantizedRows& x, const uint8_t* codes, const at::Half* scales, Out* y, int64_t m0,
                  int64_t K, int64_t N, int64_t block0) {
  using F = Format<kBits, kGroup>;
  const int64_t groups = K / kGroup;
  __m512 acc[kM][kNB];
  for (int64_t m = 0; m < kM; ++m)
    for (int64_t j = 0; j < kNB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[kM][kNB];
    for (int64_t m = 0; m < kM; ++m)
      for (int64_t j = 0; j < kNB; ++j) dots[m][j] = _mm512_setzero_si512();
    const auto pair = [&](int64_t p, const __m512i (&w)[kNB]) {
      for (int64_t m = 0; m < kM; ++m) {
        int32_t two;
        std::memcpy(&two, x.codes.data() + (m0 + m) * K + g * kGroup + 2 * p, sizeof(two));
        const __m512i xv = _mm512_set1_epi32(two);
        for (int64_t j = 0; j < kNB; ++j) dots[m][j] = dot_i16(dots[m][j], w[j], xv);
      }
    };
    const uint8_t* group_codes[kNB];
    for (int64_t j = 0; j < kNB; ++j) group_codes[j] = codes + ((block0 + j) * groups + g) * F::kGroupBytes;
    if (g + kAhead < groups) {
      for (int64_t j = 0; j < kNB; ++j) {
        const char* ahead = reinterpret_cast<const char*>(group_codes[j] + kAhead * F::kGroupBytes);
        for (int64_t byte = 0; byte < F::kGroupBytes; byte += 64) _mm_prefetch(ahead + byte, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(scales + ((block0 + j) * groups + g + kAhead) * 2 * kCols), _MM_HINT_T0);
      }
    }
    const auto load32 = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
    if constexpr (kBits == 8) {
      for (int64_t p = 0; p < kGroup / 2; ++p) {
        __m512i w[kNB];
        for (int64_t j = 0; j < kNB; ++j) w[j] = _mm512_cvtepu8_epi16(load32(group_codes[j] + p * 32));
        pair(p, w);
      }
    } else {
      const __m256i nibble = _mm256_set1_epi8(0x0f);
      for (int64_t v = 0; v < 8; ++v) {
        __m512i low[kNB], high[kNB];
        for (int64_t j = 0; j < kNB; ++j) {
          const __m256i raw = load32(group_codes[j] + v * 32);
          low[j] = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, nibble));
          high[j] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble));
        }
        pair(v, low);
        pair(v + 8, high);
      }
    }
    // Each row's scale and scaled code sum over this group, for every block.
    __m512 dx[kM], sx[kM];
    for (int64_t m = 0; m < kM; ++m) {
      const int64_t k0 = (m0 + m) * K + g * kGroup;
      float sum = 0;
      for (int64_t h = 0; h < kGroup / kSumGroup; ++h) sum += x.scaled_sums[k0 / kSumGroup + h];
      dx[m] = _mm512_set1_ps(x.scales[k0 / kActGroup]);
      sx[m] = _mm512_set1_ps(sum);
    }
    for (int64_t j = 0; j < kNB; ++j) {
      const at::Half* s = scales + ((block0 + j) * groups + g) * 2 * kCols;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kCols)));
      for (int64_t m = 0; m < kM; ++m) {
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m][j]), _mm512_mul_ps(d, dx[m]), acc[m][j]);
        acc[m][j] = _mm512_fmadd_ps(mins, sx[m], acc[m][j]);
      }
    }
  }
  for (int64_t j = 0; j < kNB; ++j) {
    const int64_t col = (block0 + j) * kCols, valid = std::min(kCols, N - col);
    for (int64_t m = 0; m < kM; ++m) store_first(y + (m0 + m) * N + col, acc[m][j], valid);
  }
}

// Rows [first, last) against kNB blocks: 4 rows at a time, then the rest.
template <int kBits, int64_t kGroup, int64_t kNB, typename Out>
void rows_for_blocks(const QuantizedRows& x, const uint8_t* codes, const at::Half* scales, Out* y, int64_t first,
                     int64_t last, int64_t K, int64_t N, int64_t block0) {
  int64_t m = first;
  for (; m + 4 <= last; m += 4) micro_kernel<kBits, kGroup, 4, kNB>(x, codes, scales, y, m, K, N, block0);
  switch (last - m) {
    case 3: micro_kernel<kBits, kGroup, 3, kNB>(x, codes, scales, y, m, K, N, block0); break;
    case 2: micro_kernel<kBits, kGroup, 2, kNB>(x, codes, scales, y, m, K, N, block0); break;
    case 1: micro_kernel<kBits, kGroup, 1, kNB>(x, codes, scales, y, m, K, N, block0); break;
    default: break;
  }
}

// Threads take runs of 4 column blocks in turn. One or two rows (decode) meet 4 blocks per call:
// enough independent dot-product chains to hide their latency; more rows meet 2 at a time, so
// the accumulators stay in registers.
template <int kBits, int64_t kGroup, typename Out>
void quantized_linear_rows(const QuantizedRows& x, const uint8_t* codes, const at::Half* scales, Out* y,
                           int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kRun = 4;
  const int64_t blocks = (N + kCols - 1) / kCols, runs = (blocks + kRun - 1) / kRun;
  parallel_chunks(runs, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const int64_t block0 = r * kRun, nb = std::min(kRun, blocks - block0);
      if (nb == kRun && M == 1) {
        micro_kernel<kBits, kGroup, 1, 4>(x, codes, scales, y, 0, K, N, block0);
      } else if (nb == kRun && M == 2) {
        micro_kernel<kBits, kGroup, 2, 4>(x, codes, scales, y, 0, K, N, block0);
      } else {
        for (int64_t b = block0; b < block0 + nb; b += 2) {
          if (b + 2 <= block0 + nb) rows_for_blocks<kBits, kGroup, 2>(x, codes, scales, y, 0, M, K, N, b);
          else rows_for_blocks<kBits, kGroup, 1>(x, codes, scales, y, 0, M, K, N, b);
        }
      }
    }
  });
}

// Prompt rows: each thread dequantizes a group of column blocks into bfloat16 (a panel, in cache),
// then multiplies every row of x by it with packed_linear's kernel, which runs at the machine's
// bfloat16 matmul rate: with many rows, dequantizing once costs far less than the int16 path's
// per-group scaling of every product.
template <int kBits, int64_t kGroup, typename Out>
void dense_rows(const at::BFloat16* x, const uint8_t* codes, const at::Half* scales, Out* y, int64_t M, int64_t K,
                int64_t N) {
  const int64_t blocks = (N + kCols - 1) / kCols, block_elems = K * kCols;
  const int64_t groups = (blocks + kPackedGroupBlocks - 1) / kPackedGroupBlocks;
  parallel_chunks(groups, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<at::BFloat16> panel;  // grown once, not zeroed each call
    if (panel.size() < static_cast<size_t>(kPackedGroupBlocks * block_elems)) panel.resize(kPackedGroupBlocks * block_elems);
    for (int64_t group = first; group < last; ++group) {
      const int64_t block0 = group * kPackedGroupBlocks, nb = std::min(kPackedGroupBlocks, blocks - block0);
      for (int64_t j = 0; j < nb; ++j)
        dequantize_block<kBits, kGroup>(codes, scales, block0 + j, K, panel.data() + j * block_elems);
      packed_bf16_group(x, panel.data(), y, M, K, N, block0, nb);
    }
  });
}

template <typename Out>
void dispatch_format(int64_t bits, int64_t group, const QuantizedRows& x, const uint8_t* codes,
                     const at::Half* scales, Out* y, int64_t M, int64_t K, int64_t N) {
  if (bits == 4 && group == 32) quantized_linear_rows<4, 32>(x, codes, scales, y, M, K, N);
  else if (bits == 8 && group == 32) quantized_linear_rows<8, 32>(x, codes, scales, y, M, K, N);
  else if (bits == 8 && group == 16) quantized_linear_rows<8, 16>(x, codes, scales, y, M, K, N);
  else TORCH_CHECK(false, "quantized_linear: no kernel for ", bits, "-bit codes in groups of ", group);
}

template <typename Out>
void dispatch_dense(int64_t bits, int64_t group, const at::BFloat16* x, const uint8_t* codes, const at::Half* scales,
                    Out* y, int64_t M, int64_t K, int64_t N) {
  if (bits == 4 && group == 32) dense_rows<4, 32>(x, codes, scales, y, M, K, N);
  else if (bits == 8 && group == 32) dense_rows<8, 32>(x, codes, scales, y, M, K, N);
  else if (bits == 8 && group == 16) dense_rows<8, 16>(x, codes, scales, y, M, K, N);
  else TORCH_CHECK(false, "quantized_linear: no kernel for ", bits, "-bit codes in groups of ", group);
}

// One pass of quantized_moe: each active expert's rows of x (rows[a] from starts[a], expert ids[a])
// against its weight (codes and scales of expert ids[a] in the stacked tensors), into y; threads
// take (expert, run of 2 column blocks) items in turn, as packed_moe's passes do.
template <int kBits, int64_t kGroup, typename Out>
void quantized_experts_pass(const QuantizedRows& x, const uint8_t* codes, const at::Half* scales,
                            const std::vector<int64_t>& ids, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& rows, Out* y, int64_t K, int64_t N) {
  const int64_t blocks = (N + kCols - 1) / kCols, runs = (blocks + 1) / 2, groups = K / kGroup;
  const int64_t code_stride = blocks * groups * Format<kBits, kGroup>::kGroupBytes;
  const int64_t scale_stride = blocks * groups * 2 * kCols;
  parallel_chunks(static_cast<int64_t>(ids.size()) * runs, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t a = item / runs, b = (item % runs) * 2;
      const uint8_t* c = codes + ids[a] * code_stride;
      const at::Half* s = scales + ids[a] * scale_stride;
      const int64_t m0 = starts[a], m1 = starts[a] + rows[a];
      if (b + 2 <= blocks) rows_for_blocks<kBits, kGroup, 2>(x, c, s, y, m0, m1, K, N, b);
      else rows_for_blocks<kBits, kGroup, 1>(x, c, s, y, m0, m1, K, N, b);
    }
  });
}

template <typename T>
void quantized_experts_dispatch(const QuantizedRows& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                                int64_t group, const std::vector<int64_t>& ids, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& rows, T* y, int64_t K, int64_t N) {
  const auto* c = codes.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<at::Half>();
  if (bits == 4 && group == 32) quantized_experts_pass<4, 32>(x, c, s, ids, starts, rows, y, K, N);
  else if (bits == 8 && group == 32) quantized_experts_pass<8, 32>(x, c, s, ids, starts, rows, y, K, N);
  else if (bits == 8 && group == 16) quantized_experts_pass<8, 16>(x, c, s, ids, starts, rows, y, K, N);
  else TORCH_CHECK(false, "quantized_moe: no kernel for ", bits, "-bit codes in groups of ", group);
}

// quantized_moe for x of dtype T (float or bfloat16): both passes' rows quantized to int16 as
// quantized_linear quantizes its x.
template <typename T>
at::Tensor quantized_moe_typed(const at::Tensor& x, const at::Tensor& top_ids, const at::Tensor& top_weights,
                               const at::Tensor& gate_up_codes, const at::Tensor& gate_up_scales, int64_t gate_up_bits,
                               int64_t gate_up_group, const at::Tensor& down_codes, const at::Tensor& down_scales,
                               int64_t down_bits, int64_t down_group, int64_t first, int64_t width) {
  const int64_t tokens = x.size(0), H = x.size(1), k = top_ids.size(1);
  const RoutedRows routed = route_rows(top_ids, first, gate_up_codes.size(0));
  auto out = at::zeros({tokens, H}, x.options().dtype(at::kFloat));
  if (routed.total == 0) return out.to(x.scalar_type());
  const auto gathered = gather_rows(x, routed.pair_of, k);
  auto gate_up = at::empty({routed.total, 2 * width}, x.options());
  quantized_experts_dispatch(quantize_rows(gathered.data_ptr<T>(), routed.total, H), gate_up_codes, gate_up_scales,
                             gate_up_bits, gate_up_group, routed.ids, routed.starts, routed.rows,
                             gate_up.data_ptr<T>(), H, 2 * width);
  const auto hidden = silu_mul(gate_up);
  auto down = at::empty({routed.total, H}, x.options());
  quantized_experts_dispatch(quantize_rows(hidden.data_ptr<T>(), routed.total, width), down_codes, down_scales,
                             down_bits, down_group, routed.ids, routed.starts, routed.rows, down.data_ptr<T>(), width,
                             H);
  add_weighted_rows(out, down, top_weights, routed.pair_of, k);
  return out.to(x.scalar_type());
}

}  // namespace

at::Tensor quantized_moe(const at::Tensor& x, const at::Tensor& top_ids, const at::Tensor& top_weights,
                         const at::Tensor& gate_up_codes, const at::Tensor& gate_up_scales, int64_t gate_up_bits,
                         int64_t gate_up_group, const at::Tensor& down_codes, const at::Tensor& down_scales,
                         int64_t down_bits, int64_t down_group, int64_t first, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && width % 32 == 0 && x.size(1) % 32 == 0, "quantized_moe: layout");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantized_moe: x float32 or bfloat16");
  TORCH_CHECK(gate_up_codes.is_contiguous() && gate_up_scales.is_contiguous() && down_codes.is_contiguous() &&
                  down_scales.is_contiguous() && gate_up_scales.scalar_type() == at::kHalf &&
                  down_scales.scalar_type() == at::kHalf,
              "quantized_moe: stacked uint8 codes and float16 scales");
  check_routing(x, top_ids, top_weights, "quantized_moe");
  if (x.scalar_type() == at::kBFloat16) {
    return quantized_moe_typed<at::BFloat16>(x, top_ids, top_weights, gate_up_codes, gate_up_scales, gate_up_bits,
                                             gate_up_group, down_codes, down_scales, down_bits, down_group, first,
                                             width);
  }
  return quantized_moe_typed<float>(x, top_ids, top_weights, gate_up_codes, gate_up_scales, gate_up_bits,
                                    gate_up_group, down_codes, down_scales, down_bits, down_group, first, width);
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t N,
                            int64_t bits, int64_t group, bool float32_out, int64_t dense_from) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous(),
              "quantized_linear: layout");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf,
              "quantized_linear: uint8 codes and float16 scales");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + kCols - 1) / kCols;
  TORCH_CHECK(K % kActGroup == 0 && K % group == 0, "quantized_linear: K must be a multiple of 32");
  TORCH_CHECK(codes.numel() == blocks * K * kCols * bits / 8 && scales.numel() == blocks * (K / group) * 2 * kCols,
              "quantized_linear: codes and scales do not match x's K and N");
  const int64_t int16_rows = std::clamp<int64_t>(dense_from, 0, M);
  TORCH_CHECK(int16_rows == M || x.scalar_type() == at::kBFloat16, "quantized_linear: dense rows need bfloat16 x");
  QuantizedRows rows;
  if (x.scalar_type() == at::kFloat) {
    rows = quantize_rows(x.data_ptr<float>(), int16_rows, K);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quantized_linear: x float32 or bfloat16");
    rows = quantize_rows(x.data_ptr<at::BFloat16>(), int16_rows, K);
  }
  const auto out_dtype = float32_out ? at::kFloat : x.scalar_type();
  auto y = at::empty({M, N}, x.options().dtype(out_dtype));
  const auto* c = codes.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<at::Half>();
  const auto run = [&](auto* out) {
    if (int16_rows > 0) dispatch_format(bits, group, rows, c, s, out, int16_rows, K, N);
    if (int16_rows < M) {
      const auto* dense_x = x.data_ptr<at::BFloat16>() + int16_rows * K;
      dispatch_dense(bits, group, dense_x, c, s, out + int16_rows * N, M - int16_rows, K, N);
    }
  };
  if (out_dtype == at::kFloat)
    run(y.data_ptr<float>());
  else run(y.data_ptr<at::BFloat16>());
  return y;
}
