// Paged decode attention that reads K/V blocks in place (no gather), where torch's eager ops are
// far from this machine's limits; and a flat batch's attention (decode rows here, prompt chunks
// in cpu_prefill_attention.cpp). float32 and bfloat16. Work is split by parallel_chunks
// (parallel.h) over torch's own thread pool, so torch.set_num_threads holds.
#include <ATen/Parallel.h>
#include <ATen/ops/index.h>
#include <ATen/ops/index_put.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_attention.h"
#include "parallel.h"
#include "simd.h"

namespace {

// Sixteen vectors v[t] -> one vector whose lane t is the sum of v[t]'s lanes: a tree of 30
// shuffles and 15 adds, where sixteen horizontal sums would take ~130 dependent ops.
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] and v[2i+1] alternate, half summed
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: tokens 4i..4i+3, each over that lane's elements
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xdd));
}

// A query row against one key row: 16 partial sums (their total is the score). bfloat16 keys
// meet the bfloat16 query in the CPU's pairwise dot product where it has one (no widening).
template <typename T, int64_t kDV>
struct QueryRow {
  alignas(64) float q[kDV * 16];
  void set(const T* src) {
    for (int64_t v = 0; v < kDV; ++v) _mm512_store_ps(q + v * 16, load16(src + v * 16));
  }
  __m512 dot(const T* k) const {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t v = 0; v < kDV; ++v) acc = _mm512_fmadd_ps(_mm512_load_ps(q + v * 16), load16(k + v * 16), acc);
    return acc;
  }
};

#ifdef __AVX512BF16__
template <int64_t kDV>
struct QueryRow<at::BFloat16, kDV> {
  static constexpr int64_t kPairs = kDV / 2;  // 32 values per dot product; an odd 16 at the end
  __m512bh q[kPairs + 1];
  void set(const at::BFloat16* src) {
    for (int64_t u = 0; u < kPairs; ++u) q[u] = (__m512bh)_mm512_loadu_si512(src + u * 32);
    if constexpr (kDV % 2) q[kPairs] = (__m512bh)_mm512_maskz_loadu_epi16(0xffff, src + kPairs * 32);
  }
  __m512 dot(const at::BFloat16* k) const {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t u = 0; u < kPairs; ++u) acc = _mm512_dpbf16_ps(acc, q[u], (__m512bh)_mm512_loadu_si512(k + u * 32));
    if constexpr (kDV % 2)
      acc = _mm512_dpbf16_ps(acc, q[kPairs], (__m512bh)_mm512_maskz_loadu_epi16(0xffff, k + kPairs * 32));
    return acc;
  }
};
#endif

// One KV head's share of a request's decode row: its G query heads and their running softmax.
template <typename T, int64_t kDV>
struct KVHeadState {
  static constexpr int64_t kMaxG = 16;
  QueryRow<T, kDV> rows[kMaxG];
  alignas(64) float acc[kMaxG][kDV * 16];
  float running_max[kMaxG], running_sum[kMaxG];
};

constexpr int64_t kKeyBlock = 128;  // keys whose softmax a decode row takes at once

// One request's decode row against KV heads [g0, g1) of its paged K/V, kKeyBlock keys at a time:
// per KV head, the block's scores for each of its G query heads (16 keys' dot products summed by
// one tree), each head's softmax over the block at once, then P.V with the output rows of up to
// kHeads heads in registers, so each value row is widened to float32 once for all of them and
// the heads' accumulators are independent FMA chains. One task walks all of its KV heads block
// by block, so it reads each token's rows as one run (the cache interleaves KV heads per token)
// instead of G-strided pieces. It takes keys [key_begin, key_end) of the request: its G rows'
// outputs normalized into out, or, for one split of its keys (flash decoding, KV head g0 alone),
// each head's unnormalized output, max and sum into `partial` ([head][D + 2]) for merge_splits.
template <typename T, int64_t kDV>
void attend_request(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t key_begin,
                    int64_t key_end, int64_t block_size, int64_t kv_stride, int64_t g0, int64_t g1, int64_t G,
                    float scale, T* out, float* partial) {
  constexpr int64_t D = kDV * 16, kChunk = 16, kHeads = std::max<int64_t>(1, 16 / kDV);
  std::vector<KVHeadState<T, kDV>> states(g1 - g0);
  for (int64_t g = g0; g < g1; ++g) {
    auto& state = states[g - g0];
    for (int64_t h = 0; h < G; ++h) {
      state.rows[h].set(q + (g * G + h) * D);
      for (int64_t d = 0; d < D; ++d) state.acc[h][d] = 0.f;
      state.running_max[h] = -std::numeric_limits<float>::infinity();
      state.running_sum[h] = 0.f;
    }
  }
  alignas(64) float scores[KVHeadState<T, kDV>::kMaxG][kKeyBlock];
  int64_t offsets[2 * kKeyBlock];  // of the block's keys and the next block's in a cache
  // A layer's cache is far from the core (a step streams every weight between two visits), and
  // pages of the pool come in any order: while a block's scores are taken, the next block's keys
  // and values are asked for, a few lines between one head's dot products and the next's. A
  // burst of all of a tile's lines fills the core's miss buffers and stalls it until they drain
  // (one core, 8 requests at 2,048 tokens: 7.9 GB/s from memory with bursts, 11-12 spread).
  constexpr int64_t kRowLines = (kDV * 16 * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const char* lines[kChunk * 2 * kRowLines];
  const auto line_list = [&](const int64_t* first, int64_t count, int64_t g) {
    int64_t n = 0;
    for (int64_t t = 0; t < count; ++t)
      for (int64_t line = 0; line < kRowLines; ++line) {
        lines[n++] = reinterpret_cast<const char*>(k_cache + first[t] + g * D) + 64 * line;
        lines[n++] = reinterpret_cast<const char*>(v_cache + first[t] + g * D) + 64 * line;
      }
    return n;
  };
  for (int64_t start = key_begin; start < key_end; start += kKeyBlock) {
    const int64_t tokens = std::min(kKeyBlock, key_end - start), ahead = std::min(2 * kKeyBlock, key_end - start);
    paged_offsets(table, block_size, kv_stride, start, ahead, offsets);
    if (start == key_begin)  // the first block: nothing asked for it ahead
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t first = 0; first < tokens; first += kChunk) {
          const int64_t n = line_list(offsets + first, std::min(kChunk, tokens - first), g);
          for (int64_t i = 0; i < n; ++i) _mm_prefetch(lines[i], _MM_HINT_T2);
        }
    for (int64_t g = g0; g < g1; ++g) {
      auto& state = states[g - g0];
      for (int64_t tile = 0; tile * kChunk < tokens; ++tile) {
        const int64_t first = tile * kChunk, count = std::min(kChunk, tokens - first);
        const int64_t next = std::clamp<int64_t>(ahead - kKeyBlock - first, 0, kChunk);
        const int64_t num_lines = line_list(offsets + kKeyBlock + first, next, g);
        const T* k_rows[kChunk];
        for (int64_t t = 0; t < count; ++t) k_rows[t] = k_cache + offsets[first + t] + g * D;
        for (int64_t h = 0; h < G; ++h) {
          for (int64_t i = h * num_lines / G; i < (h + 1) * num_lines / G; ++i) _mm_prefetch(lines[i], _MM_HINT_T2);
          __m512 dots[kChunk];
          for (int64_t t = 0; t < kChunk; ++t) dots[t] = t < count ? state.rows[h].dot(k_rows[t]) : _mm512_setzero_ps();
          _mm512_store_ps(&scores[h][first], _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(scale)));
        }
      }
      float correction[KVHeadState<T, kDV>::kMaxG];
      for (int64_t h = 0; h < G; ++h) {  // scores become probabilities in place
        const auto store = [&](int64_t t, __m512 p) { _mm512_store_ps(&scores[h][t * 16], p); };
        correction[h] = block_softmax(scores[h], tokens, state.running_max[h], state.running_sum[h], store);
      }
      row_groups<kHeads>(G, [&](int64_t h0, auto heads) {
        constexpr int64_t R = decltype(heads)::value;
        __m512 o[R][kDV];
        for (int64_t r = 0; r < R; ++r)
          for (int64_t v = 0; v < kDV; ++v)
            o[r][v] = _mm512_mul_ps(_mm512_load_ps(&state.acc[h0 + r][v * 16]), _mm512_set1_ps(correction[h0 + r]));
        for (int64_t t = 0; t < tokens; ++t) {
          const T* row = v_cache + offsets[t] + g * D;
          __m512 values[kDV];
          for (int64_t v = 0; v < kDV; ++v) values[v] = load16(row + v * 16);
          for (int64_t r = 0; r < R; ++r) {
            const __m512 p = _mm512_set1_ps(scores[h0 + r][t]);
            for (int64_t v = 0; v < kDV; ++v) o[r][v] = _mm512_fmadd_ps(p, values[v], o[r][v]);
          }
        }
        for (int64_t r = 0; r < R; ++r)
          for (int64_t v = 0; v < kDV; ++v) _mm512_store_ps(&state.acc[h0 + r][v * 16], o[r][v]);
      });
    }
  }
  for (int64_t g = g0; g < g1; ++g) {
    const auto& state = states[g - g0];
    for (int64_t h = 0; h < G; ++h) {
      if (partial != nullptr) {
        float* split = partial + h * (D + 2);
        std::copy_n(state.acc[h], D, split);
        split[D] = state.running_max[h], split[D + 1] = state.running_sum[h];
        continue;
      }
      const float inv = state.running_sum[h] > 0.f ? 1.f / state.running_sum[h] : 0.f;
      for (int64_t d = 0; d < D; ++d) out[(g * G + h) * D + d] = static_cast<T>(state.acc[h][d] * inv);
    }
  }
}

// One head's output from its `splits` partials ([split][D + 2], consecutive heads G * (D + 2)
// apart): each split's sums rescaled to the heads' common max (an empty split weighs nothing).
template <typename T>
void merge_splits(const float* partials, int64_t splits, int64_t G, int64_t D, T* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t stride = G * (D + 2);
  float top = kNegInf;
  for (int64_t s = 0; s < splits; ++s) top = std::max(top, partials[s * stride + D]);
  alignas(64) float acc[256] = {};  // D <= 256 (paged_decode_attention checks)
  float sum = 0.f;
  for (int64_t s = 0; s < splits; ++s) {
    const float* split = partials + s * stride;
    const float weight = split[D] == kNegInf ? 0.f : std::exp(split[D] - top);
    sum += split[D + 1] * weight;
    for (int64_t d = 0; d < D; ++d) acc[d] += split[d] * weight;
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

// attend_request for this head_dim: one instantiation per multiple of 16 up to 256.
template <typename T, int64_t kDV = 1>
auto attend_for_head_dim(int64_t D) {
  if constexpr (kDV < 16) {
    if (D != kDV * 16) return attend_for_head_dim<T, kDV + 1>(D);
  }
  return &attend_request<T, kDV>;
}

template <typename T>
void paged_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
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
  const float s = static_cast<float>(scale);
  if (R == 0) return;
  // A task is a request's KV heads, all of them when there are requests enough to keep every
  // thread busy. Fewer requests than that: a task is one KV head and, for contexts longer than a
  // key block, a split of its keys, merged after (flash decoding), so that a single decode gives
  // every thread an equal share (its 3 KV heads alone left one of 2 threads idle a third of
  // the time).
  const int64_t threads = at::get_num_threads();
  const int64_t longest = *std::max_element(lens, lens + R);
  const int64_t splits = R * KVH >= 2 * threads
                             ? 1
                             : std::min((2 * threads + R * KVH - 1) / (R * KVH), (longest + kKeyBlock - 1) / kKeyBlock);
  if (splits > 1) {
    std::vector<float> partials(R * KVH * splits * G * (D + 2));
    const auto split_point = [&](int64_t len, int64_t split) {
      return split == splits ? len : len * split / splits / 16 * 16;
    };
    parallel_chunks(R * KVH * splits, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t r = task / (KVH * splits), g = task / splits % KVH, split = task % splits;
        attend(qp + r * H * D, kp, vp, tables + r * max_blocks, split_point(lens[r], split),
               split_point(lens[r], split + 1), block_size, kv_stride, g, g + 1, G, s, nullptr,
               partials.data() + task * G * (D + 2));
      }
    });
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < KVH; ++g)
        for (int64_t h = 0; h < G; ++h)
          merge_splits(partials.data() + ((r * KVH + g) * splits * G + h) * (D + 2), splits, G, D,
                       op + (r * H + g * G + h) * D);
    return;
  }
  const int64_t parts = std::min(KVH, std::max<int64_t>(1, (2 * threads + R - 1) / R));
  parallel_chunks(R * parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t r = task / parts, part = task % parts;
      attend(qp + r * H * D, kp, vp, tables + r * max_blocks, 0, lens[r], block_size, kv_stride, part * KVH / parts,
             (part + 1) * KVH / parts, G, s, op + r * H * D, nullptr);
    }
  });
}

}  // namespace

// query [R, H, D] (one decode token per request); caches [num_blocks, block_size, KVH, D];
// block_tables [R, max_blocks] int32; seq_lens [R] int32 (keys per request, its new one included).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "layout");
  TORCH_CHECK(query.size(2) % 16 == 0 && query.size(2) <= 256, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(1) / k_cache.size(2) <= 16, "GQA group");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32");
  auto out = at::empty_like(query);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  if (query.scalar_type() == at::kFloat) {
    paged_decode<float>(query, k_cache, v_cache, tables, lens, scale, out);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, "float32 or bfloat16");
    paged_decode<at::BFloat16>(query, k_cache, v_cache, tables, lens, scale, out);
  }
  return out;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const PagedAttentionArgs& attention, double scale) {
  const auto& [block_tables, cu_seqlens_q, seq_lens_kv, max_query_len, decode] = attention;
  const auto q = query.contiguous();  // a view of the fused projection: rows strided
  if (decode && max_query_len == 1)  // decodes only: row i is request i's
    return paged_decode_attention(q, k_cache, v_cache, std::get<1>(*decode), std::get<2>(*decode), scale);
  auto out = at::empty_like(q);
  if (decode) {
    const auto& [rows, tables, lens] = *decode;
    out.index_put_({rows}, paged_decode_attention(q.index({rows}), k_cache, v_cache, tables, lens, scale));
  }
  paged_prefill_attention_(out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_kv, scale);
  return out;
}
