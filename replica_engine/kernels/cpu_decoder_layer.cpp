// A dense decoder layer of the Llama family in one call from Python (see models/fused_layer.py):
// the same kernels, in the same order, on the same rows as DecoderLayer.forward calls them one
// by one. At a decode step's few rows a layer's Python (a dozen module and wrapper calls around
// ten kernel calls) cost about as much as its matmuls over a 4-bit model; here it is one call.
#include "cpu_decoder_layer.h"

#include "cpu_linear.h"
#include "cpu_pointwise.h"

namespace {

at::Tensor project(const at::Tensor& x, const LayerLinear& w, int64_t dense_from) {
  const auto& [data, scales, out_features, bits, group] = w;
  if (scales) return quantized_linear(x, data, *scales, out_features, bits, group, false, dense_from);
  return packed_linear(x, data, out_features, false);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layer(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                                                 const LayerNorms& norms, const std::vector<LayerLinear>& linears,
                                                 const std::vector<int64_t>& heads, double scale, const at::Tensor& cos,
                                                 const at::Tensor& sin, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                                 const PagedAttentionArgs& attention, int64_t dense_from) {
  TORCH_CHECK(linears.size() == 4 && heads.size() == 3, "decoder_layer: qkv, o, gate_up, down; H, KVH, D");
  const auto& [input_norm, post_norm, eps] = norms;
  const int64_t T = hidden.size(0), H = heads[0], KVH = heads[1], D = heads[2];
  // The residual stream starts as the first layer's input; rms_norm adds into it in place.
  const at::Tensor stream = residual ? *residual : hidden;
  const auto qkv = project(rms_norm(hidden, input_norm, eps, residual), linears[0], dense_from);
  auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
  auto k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
  const auto v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
  rotary_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
  const auto attended = paged_attention(q, k_cache, v_cache, attention, scale);
  const auto out = project(attended.view({T, H * D}), linears[1], dense_from);
  const auto gate_up = project(rms_norm(out, post_norm, eps, stream), linears[2], dense_from);
  return {project(silu_mul(gate_up), linears[3], dense_from), stream};
}

DecoderStack::DecoderStack(std::vector<LayerNorms> norms, std::vector<std::vector<LayerLinear>> linears,
                           std::vector<int64_t> heads, double scale)
    : norms_(std::move(norms)), linears_(std::move(linears)), heads_(std::move(heads)), scale_(scale) {
  TORCH_CHECK(norms_.size() == linears_.size(), "DecoderStack: one norms tuple and one linears list a layer");
}

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward(
    at::Tensor hidden, std::optional<at::Tensor> residual, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
    const PagedAttentionArgs& attention, int64_t dense_from) const {
  const size_t layers = norms_.size();
  TORCH_CHECK(k_caches.size() == layers && v_caches.size() == layers, "DecoderStack: a K and a V cache a layer");
  for (size_t i = 0; i < layers; ++i) {
    auto [out, stream] = decoder_layer(hidden, residual, norms_[i], linears_[i], heads_, scale_, cos, sin, k_caches[i],
                                       v_caches[i], slot_mapping, attention, dense_from);
    hidden = std::move(out);
    residual = std::move(stream);
  }
  return {hidden, *residual};
}
