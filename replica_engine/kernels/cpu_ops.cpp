// CPU kernels for the decode-heavy part of a step, where torch's eager ops are far from this
// machine's limits: small-M linear layers (matrix-vector products that must stream weights at
// memory bandwidth) and paged decode attention that reads K/V blocks in place (no gather).
// Built at first use by replica_engine/kernels/cpu.py with -march=native; float32 and bfloat16.
// Work is split with at::parallel_for: torch's own thread pool, so torch.set_num_threads holds.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "cpu_attention.h"
#include "cpu_pointwise.h"
#include "simd.h"

namespace {

// How one row of w meets one row of x, 16 or 32 elements at a time, into float32 accumulators.
struct F32Dot {
  using T = float;
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kStep = 16;
  static Vec load(const T* p) { return _mm512_loadu_ps(p); }
  static Vec load_tail(const T* p, Mask mask) { return _mm512_maskz_loadu_ps(mask, p); }
  static __m512 fma(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
  static Mask tail_mask(int64_t n) { return static_cast<Mask>((1u << n) - 1); }
};

struct BF16AsF32Dot {  // bfloat16 widened to float32: any AVX-512 CPU
  using T = at::BFloat16;
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kStep = 16;
  static Vec load(const T* p) { return load16(p); }
  static Vec load_tail(const T* p, Mask mask) { return load16_masked(p, mask); }
  static __m512 fma(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
  static Mask tail_mask(int64_t n) { return static_cast<Mask>((1u << n) - 1); }
};

#ifdef __AVX512BF16__
struct BF16Dot {  // the CPU's bf16 dot product: 32 pairs a step, summed in float32
  using T = at::BFloat16;
  using Vec = __m512bh;
  using Mask = __mmask32;
  static constexpr int64_t kStep = 32;
  static Vec load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec load_tail(const T* p, Mask mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); }
  static __m512 fma(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
  static Mask tail_mask(int64_t n) { return static_cast<Mask>((1ull << n) - 1); }
};
using BF16Linear = BF16Dot;
#else
using BF16Linear = BF16AsF32Dot;
#endif

// Row n of y for kCols consecutive rows of x (from row m): w's row is read once, front to back,
// for all of them, into kAcc accumulators per x row over alternating k steps (independent
// chains, so the dot products do not wait on each other).
template <typename Dot, int64_t kCols, typename Out>
void linear_row(const typename Dot::T* x, const typename Dot::T* w, Out* y, int64_t m, int64_t K, int64_t N,
                int64_t n) {
  constexpr int64_t kAcc = 2;
  const int64_t k_full = K / Dot::kStep * Dot::kStep;
  __m512 acc[kCols][kAcc];
  for (int64_t c = 0; c < kCols; ++c)
    for (int64_t a = 0; a < kAcc; ++a) acc[c][a] = _mm512_setzero_ps();
  const typename Dot::T* w_row = w + n * K;
  int64_t k = 0;
  for (; k + kAcc * Dot::kStep <= k_full; k += kAcc * Dot::kStep) {
    for (int64_t a = 0; a < kAcc; ++a) {
      const typename Dot::Vec wv = Dot::load(w_row + k + a * Dot::kStep);
      for (int64_t c = 0; c < kCols; ++c)
        acc[c][a] = Dot::fma(acc[c][a], wv, Dot::load(x + (m + c) * K + k + a * Dot::kStep));
    }
  }
  for (; k < K; k += Dot::kStep) {  // what is left: whole steps, then a masked one
    const auto mask = Dot::tail_mask(std::min(Dot::kStep, K - k));
    const typename Dot::Vec wv = Dot::load_tail(w_row + k, mask);
    for (int64_t c = 0; c < kCols; ++c) acc[c][0] = Dot::fma(acc[c][0], wv, Dot::load_tail(x + (m + c) * K + k, mask));
  }
  for (int64_t c = 0; c < kCols; ++c) {
    __m512 sum = acc[c][0];
    for (int64_t a = 1; a < kAcc; ++a) sum = _mm512_add_ps(sum, acc[c][a]);
    y[(m + c) * N + n] = static_cast<Out>(_mm512_reduce_add_ps(sum));
  }
}

// y[M, N] = x[M, K] . w[N, K]^T. Threads split the rows of w; each thread reads its share of w
// once, in memory order (one sequential stream: hardware prefetchers keep up; short interleaved
// streams, 4 rows at a time, ran at ~60% of this), while the rows of x, four at a time (each w
// vector loaded once for four products), stay in L1.
template <typename Dot, typename Out>
void linear_rows(const typename Dot::T* x, const typename Dot::T* w, Out* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) linear_row<Dot, 4>(x, w, y, m, K, N, n);
      for (; m + 2 <= M; m += 2) linear_row<Dot, 2>(x, w, y, m, K, N, n);
      if (m < M) linear_row<Dot, 1>(x, w, y, m, K, N, n);
    }
  });
}

// One request's decode queries (the G query heads of one KV head, D = 16 * kDV) against its paged
// K/V, 16 tokens at a time, with an online softmax: per head, the 16 scores, their exponentials in
// one vector op, and the output rows updated in registers, rescaled as the running max moves.
template <typename T, int64_t kDV>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t seq_len,
                int64_t block_size, int64_t kv_stride, int64_t G, float scale, T* out, int64_t head_stride) {
  constexpr int64_t D = kDV * 16, kMaxG = 16, kChunk = 16;
  alignas(64) float qf[kMaxG][D];
  alignas(64) float acc[kMaxG][D];
  alignas(64) float probs[kChunk];
  float running_max[kMaxG], running_sum[kMaxG];
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t d = 0; d < D; ++d) {
      qf[h][d] = static_cast<float>(q[h * head_stride + d]) * scale;
      acc[h][d] = 0.f;
    }
    running_max[h] = -std::numeric_limits<float>::infinity();
    running_sum[h] = 0.f;
  }
  const T* k_rows[kChunk];
  const T* v_rows[kChunk];
  for (int64_t start = 0; start < seq_len; start += kChunk) {
    const int64_t tokens = std::min(kChunk, seq_len - start);
    const __mmask16 valid = static_cast<__mmask16>((1u << tokens) - 1);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t pos = start + t;
      const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
      k_rows[t] = k_cache + slot * kv_stride;
      v_rows[t] = v_cache + slot * kv_stride;
    }
    for (int64_t h = 0; h < G; ++h) {
      __m512 qv[kDV];
      for (int64_t v = 0; v < kDV; ++v) qv[v] = _mm512_load_ps(&qf[h][v * 16]);
      for (int64_t t = 0; t < tokens; ++t) {
        __m512 dot = _mm512_setzero_ps();
        for (int64_t v = 0; v < kDV; ++v) dot = _mm512_fmadd_ps(qv[v], load16(k_rows[t] + v * 16), dot);
        probs[t] = _mm512_reduce_add_ps(dot);
      }
      float correction;
      const __m512 p = online_softmax16(_mm512_maskz_loadu_ps(valid, probs), valid, running_max[h], running_sum[h],
                                        correction);
      _mm512_store_ps(probs, p);
      __m512 out_rows[kDV];
      for (int64_t v = 0; v < kDV; ++v) out_rows[v] = _mm512_mul_ps(_mm512_load_ps(&acc[h][v * 16]), _mm512_set1_ps(correction));
      for (int64_t t = 0; t < tokens; ++t) {
        const __m512 pt = _mm512_set1_ps(probs[t]);
        for (int64_t v = 0; v < kDV; ++v) out_rows[v] = _mm512_fmadd_ps(pt, load16(v_rows[t] + v * 16), out_rows[v]);
      }
      for (int64_t v = 0; v < kDV; ++v) _mm512_store_ps(&acc[h][v * 16], out_rows[v]);
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const float inv = running_sum[h] > 0.f ? 1.f / running_sum[h] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[h * head_stride + d] = static_cast<T>(acc[h][d] * inv);
  }
}

// attend_one for this head_dim: one instantiation per multiple of 16 up to 256.
template <typename T, int64_t kDV = 1>
auto attend_for_head_dim(int64_t D) {
  if constexpr (kDV < 16) {
    if (D != kDV * 16) return attend_for_head_dim<T, kDV + 1>(D);
  }
  return &attend_one<T, kDV>;
}

template <typename T>
void paged_decode(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                  torch::Tensor& out) {
  const int64_t R = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, kv_stride = KVH * D, max_blocks = block_tables.size(1);
  const T* qp = query.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const auto attend = attend_for_head_dim<T>(D);
  at::parallel_for(0, R * KVH, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t r = task / KVH, g = task % KVH;
      attend(qp + (r * H + g * G) * D, kp + g * D, vp + g * D, tables + r * max_blocks, lens[r], block_size,
             kv_stride, G, static_cast<float>(scale), op + (r * H + g * G) * D, D);
    }
  });
}

}  // namespace

// x [M, K] and weight [N, K], both float32 or both bfloat16 and contiguous; out_dtype float32,
// or the input's dtype.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, bool float32_out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear: shapes");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.dtype() == weight.dtype(), "linear: layout");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const auto out_dtype = float32_out ? torch::kFloat32 : x.scalar_type();
  auto y = torch::empty({M, N}, x.options().dtype(out_dtype));
  if (x.scalar_type() == torch::kFloat32) {
    linear_rows<F32Dot>(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "linear: float32 or bfloat16");
    const auto* xp = x.data_ptr<at::BFloat16>();
    const auto* wp = weight.data_ptr<at::BFloat16>();
    if (float32_out) linear_rows<BF16Linear>(xp, wp, y.data_ptr<float>(), M, K, N);
    else linear_rows<BF16Linear>(xp, wp, y.data_ptr<at::BFloat16>(), M, K, N);
  }
  return y;
}

// query [R, H, D] (one decode token per request); caches [num_blocks, block_size, KVH, D];
// block_tables [R, max_blocks] int32; seq_lens [R] int32 (keys per request, its new one included).
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "layout");
  TORCH_CHECK(query.size(2) % 16 == 0 && query.size(2) <= 256, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(1) / k_cache.size(2) <= 16, "GQA group");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32");
  auto out = torch::empty_like(query);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  if (query.scalar_type() == torch::kFloat32) {
    paged_decode<float>(query, k_cache, v_cache, tables, lens, scale, out);
  } else {
    TORCH_CHECK(query.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
    paged_decode<at::BFloat16>(query, k_cache, v_cache, tables, lens, scale, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs, as torch's own ops do: the event loop goes on.
  m.def("linear", &linear, "small-M linear: x @ weight.T", py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention_", &paged_prefill_attention_,
        "prompt-chunk attention over a paged KV cache, into out", py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm, after adding x into the residual when one is given",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, "rotate q and k in place", py::call_guard<py::gil_scoped_release>());
}
