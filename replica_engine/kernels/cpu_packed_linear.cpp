// Linear layers over weights packed once at load, for every row count a step has. The packed
// layout keeps 16 output columns side by side for each k (bfloat16: each pair of k), so a row of
// x meets 16 columns in one FMA (bfloat16: one dot-product instruction over the pair) of a
// broadcast x value and one weight vector: outer products, no horizontal sums, each weight vector
// loaded once for up to kRows rows of x. The dot-product kernel of cpu_ops.cpp needs a horizontal
// sum per output and reloads x for every product, which held it to half the machine's matmul
// rate from 8 rows up.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "cpu_linear.h"
#include "cpu_moe.h"
#include "cpu_pointwise.h"
#include "parallel.h"
#include "simd.h"
#include "tensor.h"

namespace {

constexpr int64_t kCols = 16;  // output columns per block: one float32 vector
constexpr int64_t kRows = 8;   // rows of x per micro-kernel call
constexpr int64_t kBlocks = kPackedGroupBlocks;  // column blocks per micro-kernel call: 24 accumulators

// How k advances for a dtype: float32 one k per FMA, bfloat16 a pair per dot product.
struct F32Packed {
  using T = float;
  static constexpr int64_t kPair = 1;
  static __m512 load_w(const T* p) { return _mm512_loadu_ps(p); }
  static __m512 bcast_x(const T* p) { return _mm512_set1_ps(*p); }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bfloat16: the CPU's dot product over a k pair (AVX512-BF16), or, without it, the pair widened
// to float32 (a bfloat16 is a float32's high half) and two FMAs.
struct BF16Packed {
  using T = at::BFloat16;
  static constexpr int64_t kPair = 2;
  static __m512 load_w(const T* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static __m512 bcast_x(const T* p) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof(pair));
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
#ifdef __AVX512BF16__
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
#else
  static __m512 fma(__m512 acc, __m512 w, __m512 x) {
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    const auto even = [](__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(v), 16)); };
    const auto odd = [&](__m512 v) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), high)); };
    return _mm512_fmadd_ps(odd(w), odd(x), _mm512_fmadd_ps(even(w), even(x), acc));
  }
#endif
};

// y[m0 : m0 + kM, block0 : block0 + nb blocks] for one group of column blocks, whose packed
// weights start at `blocks` (block0's). Each block's packed weights are kSteps vectors of 16
// columns (times kPair k values), one after another.
template <typename P, int64_t kM, int64_t kNB, typename Out>
void micro_kernel(const typename P::T* x, const typename P::T* blocks, Out* y, int64_t m0, int64_t K, int64_t N,
                  int64_t block0) {
  using T = typename P::T;
  const int64_t steps = K / P::kPair, block_elems = steps * kCols * P::kPair;
  __m512 acc[kM][kNB];
  for (int64_t m = 0; m < kM; ++m)
    for (int64_t j = 0; j < kNB; ++j) acc[m][j] = _mm512_setzero_ps();
  const T* w[kNB];
  for (int64_t j = 0; j < kNB; ++j) w[j] = blocks + j * block_elems;
  const T* xr = x + m0 * K;
  for (int64_t s = 0; s < steps; ++s) {
    __m512 wv[kNB];
    for (int64_t j = 0; j < kNB; ++j) wv[j] = P::load_w(w[j] + s * kCols * P::kPair);
    for (int64_t m = 0; m < kM; ++m) {
      const __m512 xv = P::bcast_x(xr + m * K + s * P::kPair);
      for (int64_t j = 0; j < kNB; ++j) acc[m][j] = P::fma(acc[m][j], wv[j], xv);
    }
  }
  for (int64_t j = 0; j < kNB; ++j) {
    const int64_t col = (block0 + j) * kCols, valid = std::min(kCols, N - col);
    for (int64_t m = 0; m < kM; ++m) store_first(y + (m0 + m) * N + col, acc[m][j], valid);
  }
}

// Every row of x (kRows at a time, then the rest) against kNB column blocks (from `blocks`,
// block0's packed weights).
template <typename P, int64_t kNB, typename Out>
void rows_for_blocks(const typename P::T* x, const typename P::T* blocks, Out* y, int64_t M, int64_t K, int64_t N,
                     int64_t block0) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) micro_kernel<P, kRows, kNB>(x, blocks, y, m, K, N, block0);
  switch (M - m) {  // the rest: one call with exactly that many rows
    case 7: micro_kernel<P, 7, kNB>(x, blocks, y, m, K, N, block0); break;
    case 6: micro_kernel<P, 6, kNB>(x, blocks, y, m, K, N, block0); break;
    case 5: micro_kernel<P, 5, kNB>(x, blocks, y, m, K, N, block0); break;
    case 4: micro_kernel<P, 4, kNB>(x, blocks, y, m, K, N, block0); break;
    case 3: micro_kernel<P, 3, kNB>(x, blocks, y, m, K, N, block0); break;
    case 2: micro_kernel<P, 2, kNB>(x, blocks, y, m, K, N, block0); break;
    case 1: micro_kernel<P, 1, kNB>(x, blocks, y, m, K, N, block0); break;
    default: break;
  }
}

// Every row of x against nb (1 to kBlocks) column blocks from block0 (`blocks`: their packed
// weights).
template <typename P, typename Out>
void rows_for_group(const typename P::T* x, const typename P::T* blocks, Out* y, int64_t M, int64_t K, int64_t N,
                    int64_t block0, int64_t nb) {
  if (nb == 3) rows_for_blocks<P, 3>(x, blocks, y, M, K, N, block0);
  else if (nb == 2) rows_for_blocks<P, 2>(x, blocks, y, M, K, N, block0);
  else rows_for_blocks<P, 1>(x, blocks, y, M, K, N, block0);
}

// Threads take groups of kBlocks column blocks in turn (each group's weights read once, front to
// back), and a group meets every row of x, which stays in cache.
template <typename P, typename Out>
void packed_linear_rows(const typename P::T* x, const typename P::T* packed, Out* y, int64_t M, int64_t K,
                        int64_t N) {
  const int64_t blocks = (N + kCols - 1) / kCols, groups = (blocks + kBlocks - 1) / kBlocks;
  parallel_chunks(groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const int64_t block0 = g * kBlocks;
      rows_for_group<P>(x, packed + block0 * K * kCols, y, M, K, N, block0, std::min(kBlocks, blocks - block0));
    }
  });
}

}  // namespace

template <typename Out>
void packed_bf16_group(const at::BFloat16* x, const at::BFloat16* blocks, Out* y, int64_t M, int64_t K, int64_t N,
                       int64_t block0, int64_t nb) {
  TORCH_CHECK(nb >= 1 && nb <= kBlocks, "packed_bf16_group: 1 to ", kBlocks, " blocks");
  rows_for_group<BF16Packed>(x, blocks, y, M, K, N, block0, nb);
}
template void packed_bf16_group<float>(const at::BFloat16*, const at::BFloat16*, float*, int64_t, int64_t, int64_t,
                                       int64_t, int64_t);
template void packed_bf16_group<at::BFloat16>(const at::BFloat16*, const at::BFloat16*, at::BFloat16*, int64_t,
                                              int64_t, int64_t, int64_t, int64_t);

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: a [N, K] matrix");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_linear_weight: float32 or bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kCols - 1) / kCols;
  const int64_t pair = weight.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(K % pair == 0, "pack_linear_weight: bfloat16 needs an even K");
  // [blocks, K / pair, 16, pair]: column n of block b at [b, k / pair, n % 16, k % pair].
  auto padded = at::zeros({blocks * kCols, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({blocks, kCols, K / pair, pair}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool float32_out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous() && x.dtype() == packed.dtype(),
              "packed_linear: layout");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(0) * kCols >= N && packed.size(1) * packed.size(3) == K, "packed_linear: shapes");
  const auto out_dtype = float32_out ? at::kFloat : x.scalar_type();
  auto y = at::empty({M, N}, x.options().dtype(out_dtype));
  if (x.scalar_type() == at::kFloat) {
    packed_linear_rows<F32Packed>(x.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
    return y;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_linear: float32 or bfloat16");
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  if (float32_out) packed_linear_rows<BF16Packed>(xp, wp, y.data_ptr<float>(), M, K, N);
  else packed_linear_rows<BF16Packed>(xp, wp, y.data_ptr<at::BFloat16>(), M, K, N);
  return y;
}

namespace {

// One pass of packed_moe: the rows of each active expert (rows[a] of them from starts[a], expert
// ids[a]) of x [R, K] against that expert's packed weight (weights + ids[a] * stride), into y [R, N].
// Threads take (expert, column group) items in turn: one parallel region streams every active
// expert's weights, where a call per expert paid a region's start and a cold weight's ramp each time.
template <typename P>
void experts_pass(const typename P::T* x, const typename P::T* weights, int64_t stride, const std::vector<int64_t>& ids,
                  const std::vector<int64_t>& starts, const std::vector<int64_t>& rows, typename P::T* y, int64_t K,
                  int64_t N) {
  using T = typename P::T;
  const int64_t blocks = (N + kCols - 1) / kCols, groups = (blocks + kBlocks - 1) / kBlocks;
  const int64_t active = static_cast<int64_t>(ids.size());
  // Items run expert by expert, so a chunk of them is one run of memory: ~256 KB of weights a
  // chunk (a short K's column groups are small). Eight cold experts of small-moe read in ~1.43x a
  // dense GEMV of as many bytes this way, ~1.6x an item at a time (this host, 4 runs each).
  const int64_t chunk = std::max<int64_t>(1, (256 << 10) / (kBlocks * kCols * K * static_cast<int64_t>(sizeof(T))));
  parallel_chunks(active * groups, chunk, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t a = item / groups, block0 = (item % groups) * kBlocks, nb = std::min(kBlocks, blocks - block0);
      const T* xa = x + starts[a] * K;
      const T* wa = weights + ids[a] * stride;
      T* ya = y + starts[a] * N;
      rows_for_group<P>(xa, wa + block0 * K * kCols, ya, rows[a], K, N, block0, nb);
    }
  });
}

template <typename P>
at::Tensor packed_moe_typed(const at::Tensor& x, const at::Tensor& top_ids, const at::Tensor& top_weights,
                            const at::Tensor& gate_up, const at::Tensor& down, int64_t first, int64_t width) {
  using T = typename P::T;
  const int64_t tokens = x.size(0), H = x.size(1), k = top_ids.size(1), experts = gate_up.size(0);
  const RoutedRows routed = route_rows(top_ids, first, experts);
  auto out = at::zeros({tokens, H}, x.options().dtype(at::kFloat));
  if (routed.total == 0) return out.to(x.scalar_type());
  const auto gathered = gather_rows(x, routed.pair_of, k);
  auto gate_up_rows = at::empty({routed.total, 2 * width}, x.options());
  experts_pass<P>(gathered.data_ptr<T>(), gate_up.data_ptr<T>(), gate_up.numel() / experts, routed.ids, routed.starts,
                  routed.rows, gate_up_rows.data_ptr<T>(), H, 2 * width);
  const auto hidden = silu_mul(gate_up_rows);
  auto down_rows = at::empty({routed.total, H}, x.options());
  experts_pass<P>(hidden.data_ptr<T>(), down.data_ptr<T>(), down.numel() / experts, routed.ids, routed.starts,
                  routed.rows, down_rows.data_ptr<T>(), width, H);
  add_weighted_rows(out, down_rows, top_weights, routed.pair_of, k);
  return out.to(x.scalar_type());
}

}  // namespace

at::Tensor packed_moe(const at::Tensor& x, const at::Tensor& top_ids, const at::Tensor& top_weights,
                      const at::Tensor& gate_up, const at::Tensor& down, int64_t first, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && width % 16 == 0, "packed_moe: layout");
  check_routing(x, top_ids, top_weights, "packed_moe");
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous() && gate_up.dtype() == x.dtype() &&
                  down.dtype() == x.dtype() && gate_up.size(0) == down.size(0),
              "packed_moe: stacked packed weights of x's dtype");
  if (x.scalar_type() == at::kFloat) {
    return packed_moe_typed<F32Packed>(x, top_ids, top_weights, gate_up, down, first, width);
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_moe: float32 or bfloat16");
  return packed_moe_typed<BF16Packed>(x, top_ids, top_weights, gate_up, down, first, width);
}
