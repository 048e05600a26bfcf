// Sampling's cuts, where torch's way sorts the vocabulary.
#pragma once
#include "tensor.h"

// [rows, 1]: per row of probs [rows, vocab] (float32, relative to the row's likeliest token: 1
// there), the least likely value it keeps under its top_k (int64, 0: none) and top_p (float32,
// 1: none), top-p over the top-k's renormalized mass; 0 for a row under neither (it keeps all).
at::Tensor kept_floor(const at::Tensor& probs, const at::Tensor& top_k, const at::Tensor& top_p);
