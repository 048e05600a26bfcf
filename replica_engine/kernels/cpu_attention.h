// Attention kernels over the paged KV cache that are not in cpu_ops.cpp.
#pragma once
#include <torch/extension.h>

// The prompt-chunk rows (requests with more than one query row) of a flat batch: query and out
// [T, H, D], caches [num_blocks, block_size, KVH, D], block_tables [R, max_blocks], cu_seqlens_q
// [R + 1] and seq_lens [R] (keys per request, this step's included), all int32. Writes those rows
// of out; decode rows are left untouched.
void paged_prefill_attention_(torch::Tensor out, const torch::Tensor& query, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& cu_seqlens_q, const torch::Tensor& seq_lens, double scale);
