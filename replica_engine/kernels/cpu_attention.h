// Attention kernels over the paged KV cache.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <tuple>

// The prompt-chunk rows (requests with more than one query row) of a flat batch: query and out
// [T, H, D], caches [num_blocks, block_size, KVH, D], block_tables [R, max_blocks], cu_seqlens_q
// [R + 1] and seq_lens [R] (keys per request, this step's included), all int32. Writes those rows
// of out; decode rows are left untouched.
void paged_prefill_attention_(torch::Tensor out, const torch::Tensor& query, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& cu_seqlens_q, const torch::Tensor& seq_lens, double scale);

// Decode rows (one query row per request) of cpu_ops.cpp: query [R, H, D], block_tables
// [R, max_blocks] and seq_lens [R] int32 -> [R, H, D].
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale);

// A step's attention metadata (attention/base.py's AttentionMetadata.kernel_args): block_tables,
// cu_seqlens_q, seq_lens_kv, max_query_len, and its decode rows (token_index, block_tables,
// seq_lens) where it has any.
using PagedAttentionArgs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t,
                                      std::optional<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>>>;

// Every query row of a flat batch [T, H, D] over the paged cache: decode rows through
// paged_decode_attention, prompt-chunk rows through paged_prefill_attention_.
torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const PagedAttentionArgs& attention, double scale);
