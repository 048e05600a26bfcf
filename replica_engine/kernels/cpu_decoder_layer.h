// A dense decoder layer in one call (cpu_decoder_layer.cpp).
#pragma once
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_attention.h"
#include "tensor.h"

// A linear layer's kernel weight: (codes, scales, N, bits, group) kept quantized, or (packed, no
// scales, N, 0, 0) packed by pack_linear_weight.
using LayerLinear = std::tuple<at::Tensor, std::optional<at::Tensor>, int64_t, int64_t, int64_t>;
// (input norm weight, post-attention norm weight, eps).
using LayerNorms = std::tuple<at::Tensor, at::Tensor, double>;
// DecoderLayer.forward of a dense layer (no bias, q/k norm, LoRA or tensor parallelism): hidden
// [T, hidden] and the residual stream (None: the first layer, the stream starts as hidden) ->
// (the MLP's output, the stream). linears: qkv, o, gate_up, down; heads: H, KVH, head_dim; cos and
// sin [T, head_dim]; caches [num_blocks, block_size, KVH, head_dim]; slot_mapping [T] int64 (where
// the step's K/V go); dense_from: quantized_linear's.
std::tuple<at::Tensor, at::Tensor> decoder_layer(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                                                 const LayerNorms& norms, const std::vector<LayerLinear>& linears,
                                                 const std::vector<int64_t>& heads, double scale, const at::Tensor& cos,
                                                 const at::Tensor& sin, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                                 const PagedAttentionArgs& attention, int64_t dense_from);

// A model's dense decoder layers, every one plain, as decoder_layer runs each, in one call a step:
// the weights are converted from Python once, not once a layer a step. forward: the first layer's
// hidden and residual (None: the stream starts as hidden) and each layer's K and V caches -> the
// last layer's (MLP output, stream).
class DecoderStack {
 public:
  DecoderStack(std::vector<LayerNorms> norms, std::vector<std::vector<LayerLinear>> linears,
               std::vector<int64_t> heads, double scale);
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                             const at::Tensor& cos, const at::Tensor& sin,
                                             const std::vector<at::Tensor>& k_caches,
                                             const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                                             const PagedAttentionArgs& attention, int64_t dense_from) const;

 private:
  std::vector<LayerNorms> norms_;
  std::vector<std::vector<LayerLinear>> linears_;
  std::vector<int64_t> heads_;
  double scale_;
};
