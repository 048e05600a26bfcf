// Linear layers over pre-packed weights (cpu_packed_linear.cpp).
#pragma once
#include "tensor.h"

// weight [N, K] (float32, or bfloat16 with an even K) -> its packed copy: [ceil(N / 16), K / p, 16, p]
// with p = 2 for bfloat16 (a k pair per dot product) and 1 for float32; columns past N are zero.
at::Tensor pack_linear_weight(const at::Tensor& weight);

// x [M, K] @ weight.T for weight packed by pack_linear_weight (N: its real rows); out float32, or
// x's dtype.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool float32_out);

// Column blocks a packed_bf16_group call takes at most.
constexpr int64_t kPackedGroupBlocks = 3;

// Rows [0, M) of bfloat16 x [M, K] against nb (1 to kPackedGroupBlocks) column blocks from block0,
// packed as pack_linear_weight packs bfloat16 (`blocks`: block0's, the others after it), into
// those columns of y [M, N]. One thread's share of packed_linear.
template <typename Out>
void packed_bf16_group(const at::BFloat16* x, const at::BFloat16* blocks, Out* y, int64_t M, int64_t K, int64_t N,
                       int64_t block0, int64_t nb);

// A mixture of experts' experts for x [T, H]: each token's picks top_ids [T, k] (int64; experts
// first.. of the stacked weights, others skipped) weighted by top_weights [T, k] (float32); gate_up
// [E, ...] and down [E, ...] each expert's packed [2I, H] and [H, I] weights stacked. Tokens are
// grouped by expert, silu(x W_gate) * (x W_up) W_down computed for each in two parallel regions,
// and summed per token in float32: [T, H] in x's dtype.
at::Tensor packed_moe(const at::Tensor& x, const at::Tensor& top_ids, const at::Tensor& top_weights,
                      const at::Tensor& gate_up, const at::Tensor& down, int64_t first, int64_t width);

// As packed_moe, over experts kept quantized (cpu_quantized_format.h's layout, each projection's
// experts stacked: codes [E, ...] uint8, scales [E, ...] float16, one format per projection); x and
// the experts' hidden rows are quantized to int16 per 32 k as quantized_linear does.
at::Tensor quantized_moe(const at::Tensor& x, const at::Tensor& top_ids, const at::Tensor& top_weights,
                         const at::Tensor& gate_up_codes, const at::Tensor& gate_up_scales, int64_t gate_up_bits,
                         int64_t gate_up_group, const at::Tensor& down_codes, const at::Tensor& down_scales,
                         int64_t down_bits, int64_t down_group, int64_t first, int64_t width);

// x [M, K] @ W.T for W kept quantized (cpu_quantized_format.h's layout: uint8 codes, float16
// scales; `bits` 4 or 8 per code, `group` 16 or 32 k per scale). Rows before `dense_from`: x is
// quantized to int16 per 32 k; rows from it on (bfloat16 x only): W dequantized to bfloat16 meets
// x in bfloat16 dot products, as packed_linear over dequantize(W).to(bfloat16) computes them.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t N,
                            int64_t bits, int64_t group, bool float32_out, int64_t dense_from);

// Rows `ids` (int32 or int64, each < N) of a weight kept quantized (quantized_linear's layout), each
// code * d + m in float32 as quantized_weight.dequantize_rows computes it -> [len(ids), K] float32,
// or rounded to bfloat16: a quantized token embedding's lookup.
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& ids, int64_t N,
                           int64_t K, int64_t bits, int64_t group, bool bfloat16_out);
