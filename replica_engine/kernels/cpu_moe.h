// What a mixture of experts' CPU kernels share (packed_moe in cpu_packed_linear.cpp, quantized_moe in
// cpu_quantized_linear.cpp): each token's (token, slot) pairs grouped by expert, the rows gathered
// in that order, and the experts' output rows weighted and summed back per token.
#pragma once
#include <cstring>
#include <vector>

#include "tensor.h"

// Both kernels' routing inputs: top_ids [T, k] int64 and top_weights [T, k] float32 for x's T rows.
inline void check_routing(const at::Tensor& x, const at::Tensor& top_ids, const at::Tensor& top_weights,
                          const char* op) {
  TORCH_CHECK(top_ids.scalar_type() == at::kLong && top_ids.dim() == 2 && top_ids.is_contiguous() &&
                  top_ids.size(0) == x.size(0),
              op, ": top_ids [T, k] int64");
  TORCH_CHECK(
      top_weights.scalar_type() == at::kFloat && top_weights.is_contiguous() && top_weights.sizes() == top_ids.sizes(),
      op, ": top_weights [T, k] float32");
}

struct RoutedRows {
  std::vector<int64_t> ids, starts, rows;  // per active expert: its id, first row, row count
  std::vector<int64_t> pair_of;            // row -> its (token, slot) pair, token * k + slot
  int64_t total = 0;
};

// A counting sort of top_ids [T, k] (int64) by expert; ids outside [first, first + experts) are
// another worker's, skipped.
inline RoutedRows route_rows(const at::Tensor& top_ids, int64_t first, int64_t experts) {
  const int64_t pairs = top_ids.numel();
  const int64_t* picked = top_ids.data_ptr<int64_t>();
  std::vector<int64_t> counts(experts, 0), next(experts);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = picked[i] - first;
    if (e >= 0 && e < experts) ++counts[e];
  }
  RoutedRows routed;
  for (int64_t e = 0; e < experts; ++e) {
    next[e] = routed.total;
    if (counts[e]) {
      routed.ids.push_back(e);
      routed.starts.push_back(routed.total);
      routed.rows.push_back(counts[e]);
    }
    routed.total += counts[e];
  }
  routed.pair_of.resize(routed.total);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = picked[i] - first;
    if (e >= 0 && e < experts) routed.pair_of[next[e]++] = i;
  }
  return routed;
}

// x's row of each routed pair, in routed order: [total, H].
inline at::Tensor gather_rows(const at::Tensor& x, const std::vector<int64_t>& pair_of, int64_t k) {
  const int64_t total = static_cast<int64_t>(pair_of.size()), H = x.size(1), bytes = H * x.element_size();
  auto gathered = at::empty({total, H}, x.options());
  const auto* source = static_cast<const char*>(x.data_ptr());
  auto* target = static_cast<char*>(gathered.data_ptr());
  for (int64_t r = 0; r < total; ++r) std::memcpy(target + r * bytes, source + (pair_of[r] / k) * bytes, bytes);
  return gathered;
}

// out [T, H] float32 += each row (rounded to its dtype, as the down projection's output is) times
// its pair's routing weight (top_weights [T, k] float32).
inline void add_weighted_rows(at::Tensor& out, const at::Tensor& rows, const at::Tensor& top_weights,
                              const std::vector<int64_t>& pair_of, int64_t k) {
  const auto values = rows.to(at::kFloat);
  const float* weights = top_weights.data_ptr<float>();
  const float* v = values.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t H = out.size(1);
  for (size_t r = 0; r < pair_of.size(); ++r) {
    const float w = weights[pair_of[r]];
    float* target = o + (pair_of[r] / k) * H;
    const float* row = v + r * H;
    for (int64_t h = 0; h < H; ++h) target[h] += w * row[h];
  }
}
