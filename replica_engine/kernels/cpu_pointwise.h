// The element-wise ops between a decoder layer's matmuls, each one pass over memory instead of
// torch's several ops (and as many allocations): at a decode step's few rows, per-op overhead is
// what they cost. Every dimension must be a multiple of 16 (callers check; torch otherwise).
#pragma once
#include <optional>

#include "tensor.h"

// x [T, D]. With a residual [T, D]: residual += x first (in place, rounded to its dtype, as the
// model's add is), and the residual is normalised. Returns the normalised rows times weight, in
// Hugging Face's order: in float32, rounded to the dtype, then the weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual);

// gate_up [T, 2I] -> silu(gate) * up [T, I]; silu rounded to the dtype before the product, as torch.
at::Tensor silu_mul(const at::Tensor& gate_up);

// Rotate-half rotary embedding, in place: q [T, H, D] and k [T, KVH, D] (rows may be strided, as
// views of the fused qkv projection), cos and sin [T, D] contiguous.
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);

// rotary_, then each token's k (rotated) and v [T, KVH, D] stored into its slot of the caches
// [blocks, block_size, KVH, D] (slot_mapping [T] int64): one call where three ops and a copy of
// the fused projection's rows were.
void rotary_store_(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping);
