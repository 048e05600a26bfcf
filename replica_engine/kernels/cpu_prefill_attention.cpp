// Prompt-chunk attention over the paged KV cache, read in place (no gather): a step's chunks
// split into tasks (query rows of one request times the G query heads that share one KV head),
// handed to the threads. In bfloat16 on a CPU with pairwise dot products a task is 32 rows, run by
// the block kernel of cpu_prefill_attention_bf16.cpp. Otherwise (float32, or no AVX512-BF16) it
// is 16 rows and flash attention's tiling here: the request's keys 16 at a time (only as far as
// its last row may see), each key tile transposed once into registers-sized rows of 16 keys, so a
// query row's 16 scores are D broadcast FMAs (no horizontal sums), and that transpose serves all
// 16 * G rows; the output rows stay in an L1-sized accumulator, rescaled as each row's running max
// moves.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_attention.h"
#include "parallel.h"
#include "simd.h"
#include "tensor.h"

namespace {

constexpr int64_t kTile = 16;  // query rows per task, keys per step: one AVX-512 float vector
constexpr int64_t kMaxD = 256, kMaxG = 16;  // as the decode kernel

// A thread's working set for one task: G * kTile query rows and their output rows (float32), and
// one tile of keys (transposed, kt[d * kTile + t]) and values (vt[t * D + d]) widened to float32
// once for every row. About 40 KB at G = 3, D = 64: L1-sized.
struct Scratch {
  explicit Scratch(int64_t G, int64_t D)
      : qf(G * kTile * D), acc(G * kTile * D), kt(D * kTile), vt(kTile * D), row_max(G * kTile), row_sum(G * kTile) {}
  std::vector<float> qf, acc, kt, vt, row_max, row_sum;
};

constexpr int64_t kRows = 4;  // output rows advanced together: independent FMA chains

// Rows [i0, i0 + kRows) of the task against one staged key tile: scores, the online softmax
// update, and P.V into their accumulators. `visible[r]`: keys of the tile row r may see (0 for a
// row whose position is before the tile; at least one row of the group sees one).
template <int64_t kDV>
inline void rows_against_tile(Scratch& scratch, int64_t i0, const int64_t* visible) {
  constexpr int64_t D = kDV * 16;
  const float* kt = scratch.kt.data();
  const float* vt = scratch.vt.data();
  __m512 s[kRows][2];
  for (int64_t r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  const float* q = scratch.qf.data() + i0 * D;
  for (int64_t d = 0; d < D; d += 2) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kTile), k1 = _mm512_loadu_ps(kt + (d + 1) * kTile);
    for (int64_t r = 0; r < kRows; ++r) {
      s[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k0, s[r][0]);
      s[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d + 1]), k1, s[r][1]);
    }
  }
  alignas(64) float probs[kRows][kTile];
  float correction[kRows];
  int64_t max_visible = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t i = i0 + r;
    const __mmask16 mask = static_cast<__mmask16>((1u << visible[r]) - 1);
    const __m512 p = online_softmax16(_mm512_add_ps(s[r][0], s[r][1]), mask, scratch.row_max[i], scratch.row_sum[i],
                                      correction[r]);
    _mm512_store_ps(probs[r], p);  // keys it may not see: probability 0
    max_visible = std::max(max_visible, visible[r]);
  }
  float* acc = scratch.acc.data() + i0 * D;
  __m512 out[kRows][kDV];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < kDV; ++v)
      out[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + v * 16), _mm512_set1_ps(correction[r]));
  for (int64_t t = 0; t < max_visible; ++t) {
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 pt = _mm512_set1_ps(probs[r][t]);
      for (int64_t v = 0; v < kDV; ++v) out[r][v] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + t * D + v * 16), out[r][v]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < kDV; ++v) _mm512_storeu_ps(acc + r * D + v * 16, out[r][v]);
}

// Rows [row0, row0 + rows) of the chunk (at most kTile), KV head g: G * rows output rows, padded
// to whole groups of kRows (padding rows repeat the last real row and are not written out).
template <typename T, int64_t kDV>
void attend_tile(const PromptChunk& chunk, int64_t row0, int64_t rows, int64_t g, const T* q, const T* k_cache,
                 const T* v_cache, T* out, int64_t H, int64_t G, int64_t block_size, int64_t KVH, float scale,
                 Scratch& scratch) {
  constexpr int64_t D = kDV * 16;
  const int64_t n = G * rows, padded = (n + kRows - 1) / kRows * kRows, kv_stride = KVH * D;
  auto q_row = [&](int64_t i) { return q + ((chunk.first_row + row0 + i / G) * H + g * G + i % G) * D; };
  for (int64_t i = 0; i < padded; ++i) {  // i = row * G + head
    const T* src = q_row(std::min(i, n - 1));
    for (int64_t v = 0; v < kDV; ++v) {
      _mm512_storeu_ps(&scratch.qf[i * D + v * 16], _mm512_mul_ps(load16(src + v * 16), _mm512_set1_ps(scale)));
      _mm512_storeu_ps(&scratch.acc[i * D + v * 16], _mm512_setzero_ps());
    }
    scratch.row_max[i] = -std::numeric_limits<float>::infinity();
    scratch.row_sum[i] = 0.f;
  }
  // Query row j of the chunk sits at position kv_len - num_rows + j and sees keys up to it.
  const int64_t first_pos = chunk.kv_len - chunk.num_rows + row0;
  const int64_t keys = first_pos + rows;  // what the tile's last row sees
  int64_t offsets[kTile];  // of the tile's keys in a cache
  for (int64_t start = 0; start < keys; start += kTile) {
    const int64_t tokens = std::min(kTile, keys - start);
    paged_offsets(chunk.table, block_size, kv_stride, start, tokens, offsets);
    for (int64_t v = 0; v < kDV; ++v) {
      __m512 block[16];
      for (int64_t t = 0; t < 16; ++t) {
        block[t] = _mm512_setzero_ps();
        if (t < tokens) {
          block[t] = load16(k_cache + offsets[t] + g * D + v * 16);
          _mm512_storeu_ps(&scratch.vt[t * D + v * 16], load16(v_cache + offsets[t] + g * D + v * 16));
        } else {
          _mm512_storeu_ps(&scratch.vt[t * D + v * 16], _mm512_setzero_ps());
        }
      }
      transpose16(block);
      for (int64_t d = 0; d < 16; ++d) _mm512_storeu_ps(&scratch.kt[(v * 16 + d) * kTile], block[d]);
    }
    for (int64_t i0 = 0; i0 < padded; i0 += kRows) {
      int64_t visible[kRows];
      for (int64_t r = 0; r < kRows; ++r) {  // keys at or before the row's position
        visible[r] = std::min(tokens, first_pos + std::min(i0 + r, n - 1) / G + 1 - start);
      }
      if (*std::max_element(visible, visible + kRows) <= 0) continue;
      for (int64_t r = 0; r < kRows; ++r) visible[r] = std::max<int64_t>(visible[r], 0);
      rows_against_tile<kDV>(scratch, i0, visible);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const float inv = scratch.row_sum[i] > 0.f ? 1.f / scratch.row_sum[i] : 0.f;
    T* dst = out + ((chunk.first_row + row0 + i / G) * H + g * G + i % G) * D;
    for (int64_t v = 0; v < kDV; ++v)
      store16(dst + v * 16, _mm512_mul_ps(_mm512_loadu_ps(&scratch.acc[i * D + v * 16]), _mm512_set1_ps(inv)));
  }
}


// attend_tile for this head_dim: one instantiation per multiple of 16 up to kMaxD.
template <typename T, int64_t kDV = 1>
auto tile_for_head_dim(int64_t D) {
  if constexpr (kDV < kMaxD / 16) {
    if (D != kDV * 16) return tile_for_head_dim<T, kDV + 1>(D);
  }
  return &attend_tile<T, kDV>;
}

// Query rows per task: twice a tile's for the bfloat16 block kernel, whose staging of each key
// block (keys transposed, values paired) all of them share.
template <typename T>
int64_t rows_per_task(int64_t D) {
  return std::is_same_v<T, at::BFloat16> && prompt_rows_bf16_supported(D) ? 2 * kTile : kTile;
}

template <typename T>
void paged_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                   double scale) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t R = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<PromptChunk> chunks;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> tasks;  // (chunk, first row, kv head)
  const int64_t task_rows = rows_per_task<T>(D);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t rows = cu[r + 1] - cu[r];
    if (rows <= 1) continue;  // a decode row: the decode kernel's
    chunks.push_back({cu[r], rows, lens[r], block_tables.data_ptr<int32_t>() + r * max_blocks});
    const int64_t num_tiles = (rows + task_rows - 1) / task_rows;
    // Tiles in the order first, last, second, second-to-last, ...: causal tiles grow in cost, so
    // the last tasks handed out are not all the dearest.
    for (int64_t k = 0; k < num_tiles; ++k) {
      const int64_t tile = k % 2 == 0 ? k / 2 : num_tiles - 1 - k / 2;
      for (int64_t g = 0; g < KVH; ++g) tasks.emplace_back(chunks.size() - 1, tile * task_rows, g);
    }
  }
  const T* qp = query.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const auto run_tasks = [&](const auto& attend_rows) {
    parallel_chunks(static_cast<int64_t>(tasks.size()), 1, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        const auto [c, row0, g] = tasks[t];
        const PromptChunk& chunk = chunks[c];
        attend_rows(chunk, row0, std::min(task_rows, chunk.num_rows - row0), g);
      }
    });
  };
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (task_rows != kTile) {  // the bfloat16 block kernel's
      run_tasks([&](const PromptChunk& chunk, int64_t row0, int64_t rows, int64_t g) {
        attend_prompt_rows_bf16(chunk, row0, rows, g, qp, kp, vp, op, H, D, G, block_size, KVH,
                                static_cast<float>(scale));
      });
      return;
    }
  }
  const auto attend = tile_for_head_dim<T>(D);
  std::vector<Scratch> scratches(at::get_num_threads(), Scratch(G, D));
  run_tasks([&](const PromptChunk& chunk, int64_t row0, int64_t rows, int64_t g) {
    attend(chunk, row0, rows, g, qp, kp, vp, op, H, G, block_size, KVH, static_cast<float>(scale),
           scratches[at::get_thread_num()]);
  });
}

}  // namespace

void paged_prefill_attention_(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                              const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "layout");
  TORCH_CHECK(query.size(2) % 16 == 0 && query.size(2) <= kMaxD, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(1) / k_cache.size(2) <= kMaxG, "GQA group");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && cu_seqlens_q.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "int32 metadata");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && k_cache.scalar_type() == query.scalar_type(), "dtypes");
  const auto tables = block_tables.contiguous();
  if (query.scalar_type() == at::kFloat) {
    paged_prefill<float>(out, query, k_cache, v_cache, tables, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
                         scale);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, "float32 or bfloat16");
    paged_prefill<at::BFloat16>(out, query, k_cache, v_cache, tables, cu_seqlens_q.contiguous(),
                                seq_lens.contiguous(), scale);
  }
}
