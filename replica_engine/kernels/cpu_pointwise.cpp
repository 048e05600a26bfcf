// See cpu_pointwise.h. Rows are split across torch's threads when there are enough of them.
#include "cpu_pointwise.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "parallel.h"
#include "simd.h"

namespace {

constexpr int64_t kRowsPerTask = 16;

template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t D, float eps) {
  parallel_chunks(rows, kRowsPerTask, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const T* src = x + t * D;
      if (residual != nullptr) {  // residual += x, stored (and normalised) in the dtype
        T* res = residual + t * D;
        for (int64_t d = 0; d < D; d += 16) store16(res + d, _mm512_add_ps(load16(res + d), load16(src + d)));
        src = res;
      }
      __m512 squares = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 v = load16(src + d);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const __m512 inv_rms = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / D + eps));
      T* dst = out + t * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 normed = round_to(dst, _mm512_mul_ps(load16(src + d), inv_rms));
        store16(dst + d, _mm512_mul_ps(load16(weight + d), normed));
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  parallel_chunks(rows, kRowsPerTask, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const T* gate = gate_up + t * 2 * I;
      const T* up = gate + I;
      T* dst = out + t * I;
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 one = _mm512_set1_ps(1.f);
        const __m512 silu = round_to(dst, _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        store16(dst + i, _mm512_mul_ps(silu, load16(up + i)));
      }
    }
  });
}

// One head of one token: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (cos and sin repeat per half).
template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 x1 = load16(x + d), x2 = load16(x + half + d);
    const __m512 c1 = load16(cos + d), s1 = load16(sin + d);
    const __m512 c2 = load16(cos + half + d), s2 = load16(sin + half + d);
    store16(x + d, _mm512_sub_ps(_mm512_mul_ps(x1, c1), _mm512_mul_ps(x2, s1)));
    store16(x + half + d, _mm512_add_ps(_mm512_mul_ps(x2, c2), _mm512_mul_ps(x1, s2)));
  }
}

// q and k rotated in place, token by token; then each token's `done(t)` (nothing, or its store).
template <typename T, typename Done>
void rotary_rows(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, const Done& done) {
  const int64_t rows = q.size(0), D = q.size(2), half = D / 2;
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  parallel_chunks(rows, kRowsPerTask, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      for (int64_t h = 0; h < q.size(1); ++h) rotate_head(qp + t * q.stride(0) + h * q.stride(1), cp + t * D, sp + t * D, half);
      for (int64_t h = 0; h < k.size(1); ++h) rotate_head(kp + t * k.stride(0) + h * k.stride(1), cp + t * D, sp + t * D, half);
      done(t);
    }
  });
}

void check_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "rotary_: q, k layout");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == q.size(2), "rotary_: cos, sin");
  TORCH_CHECK(q.size(2) % 32 == 0 && k.size(2) == q.size(2), "rotary_: head_dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type(), "rotary_: dtypes");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "rotary_: float32 or bfloat16");
}

// Token t's kv heads (each row of src holds them one after another) into its cache slot.
template <typename T>
void store_row(const at::Tensor& src, at::Tensor& cache, int64_t t, int64_t slot) {
  const int64_t heads = src.size(1), D = src.size(2);
  const T* from = src.data_ptr<T>() + t * src.stride(0);
  T* to = cache.data_ptr<T>() + slot * heads * D;
  for (int64_t h = 0; h < heads; ++h) std::memcpy(to + h * D, from + h * src.stride(1), D * sizeof(T));
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && x.size(1) % 16 == 0, "rms_norm: layout");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: dtypes");
  if (residual) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: residual");
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), D = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                         weight.data_ptr<float>(), out.data_ptr<float>(), rows, D, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16");
    using BF = at::BFloat16;
    rms_norm_rows<BF>(x.data_ptr<BF>(), residual ? residual->data_ptr<BF>() : nullptr, weight.data_ptr<BF>(),
                      out.data_ptr<BF>(), rows, D, static_cast<float>(eps));
  }
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 32 == 0, "silu_mul: layout");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({rows, I}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, I);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16");
    silu_mul_rows<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, I);
  }
  return out;
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(q, k, cos, sin);
  const auto nothing = [](int64_t) {};
  if (q.scalar_type() == at::kFloat)
    rotary_rows<float>(q, k, cos, sin, nothing);
  else rotary_rows<at::BFloat16>(q, k, cos, sin, nothing);
}

void rotary_store_(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping) {
  check_rotary(q, k, cos, sin);
  TORCH_CHECK(v.sizes() == k.sizes() && v.stride(2) == 1 && v.scalar_type() == k.scalar_type(), "rotary_store_: v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k.scalar_type() &&
                  k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "rotary_store_: caches [blocks, block_size, kv_heads, head_dim] in q's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == q.size(0) && slot_mapping.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong,
              "rotary_store_: slot_mapping [T] int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < q.size(0); ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rotary_store_: slot");
  const auto run = [&](auto typed) {
    using T = decltype(typed);
    rotary_rows<T>(q, k, cos, sin, [&](int64_t t) {
      store_row<T>(k, k_cache, t, slots[t]);
      store_row<T>(v, v_cache, t, slots[t]);
    });
  };
  if (q.scalar_type() == at::kFloat)
    run(float{});
  else run(at::BFloat16{});
}
