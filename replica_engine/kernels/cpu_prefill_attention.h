// Prompt-chunk attention's tasks, shared by the kernel that splits a step's chunks into tasks
// (cpu_prefill_attention.cpp) and the bfloat16 block kernel (cpu_prefill_attention_bf16.cpp).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

struct PromptChunk {  // one request's prompt chunk
  int64_t first_row, num_rows, kv_len;
  const int32_t* table;
};

// Whether attend_prompt_rows_bf16 serves this head_dim on this CPU (bfloat16 pairwise dot
// products, D a multiple of 32, at most 256).
bool prompt_rows_bf16_supported(int64_t D);

// Rows [row0, row0 + rows) of the chunk against KV head g: its G query heads' output rows of out.
// q and out [T, H, D], caches [num_blocks, block_size, KVH, D]; only where
// prompt_rows_bf16_supported(D).
void attend_prompt_rows_bf16(const PromptChunk& chunk, int64_t row0, int64_t rows, int64_t g, const at::BFloat16* q,
                             const at::BFloat16* k_cache, const at::BFloat16* v_cache, at::BFloat16* out, int64_t H,
                             int64_t D, int64_t G, int64_t block_size, int64_t KVH, float scale);
