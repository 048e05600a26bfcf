// Sampling's cuts, where torch's way sorts the vocabulary.
#pragma once
#include <torch/extension.h>

// [rows, 1]: per row of probs [rows, vocab] (float32, relative to the row's likeliest token: 1
// there), the least likely value it keeps under its top_k (int64, 0: none) and top_p (float32,
// 1: none), top-p over the top-k's renormalized mass; 0 for a row under neither (it keeps all).
torch::Tensor kept_floor(const torch::Tensor& probs, const torch::Tensor& top_k, const torch::Tensor& top_p);
