// Attention kernels over the paged KV cache.
#pragma once
#include <cstdint>
#include <optional>
#include <tuple>

#include "tensor.h"

// The offsets (in values) in a paged cache [num_blocks, block_size, KVH, D] of the slots of a
// request's keys [start, start + count), kv_stride = KVH * D values a slot: its block table walked
// page by page, with no division per key (block_size is not a compile-time constant).
inline void paged_offsets(const int32_t* table, int64_t block_size, int64_t kv_stride, int64_t start, int64_t count,
                          int64_t* offsets) {
  for (int64_t t = 0, page = start / block_size, in_page = start % block_size; t < count; ++t) {
    offsets[t] = (static_cast<int64_t>(table[page]) * block_size + in_page) * kv_stride;
    if (++in_page == block_size) in_page = 0, ++page;
  }
}

struct PromptChunk {  // one request's prompt chunk
  int64_t first_row, num_rows, kv_len;
  const int32_t* table;
};

// The bfloat16 block kernel of cpu_prefill_attention_bf16.cpp, which cpu_prefill_attention.cpp
// hands a step's prompt-chunk tasks to: whether it serves this head_dim on this CPU (bfloat16
// pairwise dot products, D a multiple of 32, at most 256), and rows [row0, row0 + rows) of the
// chunk against KV head g (its G query heads' output rows of out; q and out [T, H, D]).
bool prompt_rows_bf16_supported(int64_t D);
void attend_prompt_rows_bf16(const PromptChunk& chunk, int64_t row0, int64_t rows, int64_t g, const at::BFloat16* q,
                             const at::BFloat16* k_cache, const at::BFloat16* v_cache, at::BFloat16* out, int64_t H,
                             int64_t D, int64_t G, int64_t block_size, int64_t KVH, float scale);

// The prompt-chunk rows (requests with more than one query row) of a flat batch: query and out
// [T, H, D], caches [num_blocks, block_size, KVH, D], block_tables [R, max_blocks], cu_seqlens_q
// [R + 1] and seq_lens [R] (keys per request, this step's included), all int32. Writes those rows
// of out; decode rows are left untouched.
void paged_prefill_attention_(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                              const at::Tensor& seq_lens, double scale);

// Decode rows (one query row per request) of cpu_ops.cpp: query [R, H, D], block_tables
// [R, max_blocks] and seq_lens [R] int32 -> [R, H, D].
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);

// A step's attention metadata (attention/base.py's AttentionMetadata.kernel_args): block_tables,
// cu_seqlens_q, seq_lens_kv, max_query_len, and its decode rows (token_index, block_tables,
// seq_lens) where it has any.
using PagedAttentionArgs = std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t,
                                      std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>>>;

// Every query row of a flat batch [T, H, D] over the paged cache: decode rows through
// paged_decode_attention, prompt-chunk rows through paged_prefill_attention_.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const PagedAttentionArgs& attention, double scale);
