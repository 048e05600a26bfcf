// The top-k / top-p cut of a sampled row, found among its likeliest tokens only: torch's way, a
// topk over the whole 49k vocabulary, cost a CPU about a millisecond a row.
#include "cpu_sampling.h"

#include <immintrin.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "parallel.h"

namespace {

// Where a row's candidates are looked for first: its tokens at least this likely relative to its
// likeliest. A row whose top-k or nucleus reaches further looks again at the next floor.
constexpr float kCandidateFloors[] = {1e-4f, 1e-8f, 0.0f};

struct Candidates {
  int64_t count = 0;
  double mass = 0.0;  // their sum
  double total = 0.0;  // the whole row's sum
};

// The row's values at or above `floor`, compressed into `out` in vocabulary order (one pass).
Candidates collect(const float* row, int64_t V, float floor, float* out) {
  const __m512 at_least = _mm512_set1_ps(floor);
  __m512 mass = _mm512_setzero_ps(), total = _mm512_setzero_ps();
  int64_t count = 0, i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    const __mmask16 above = _mm512_cmp_ps_mask(v, at_least, _CMP_GE_OQ);
    _mm512_mask_compressstoreu_ps(out + count, above, v);
    count += __builtin_popcount(above);
    mass = _mm512_mask_add_ps(mass, above, mass, v);
    total = _mm512_add_ps(total, v);
  }
  Candidates found{count, _mm512_reduce_add_ps(mass), _mm512_reduce_add_ps(total)};
  for (; i < V; ++i) {
    found.total += row[i];
    if (row[i] >= floor) {
      out[found.count++] = row[i];
      found.mass += row[i];
    }
  }
  return found;
}

// The value at which the largest of c[0 : n) first hold `needed` of mass (the last token a
// nucleus keeps), without sorting them all: halves by selection (each an nth_element and a sum),
// then a sort of the few left.
float nucleus_floor(float* c, int64_t n, double needed) {
  int64_t lo = 0, hi = n;
  while (hi - lo > 64) {
    const int64_t mid = lo + (hi - lo) / 2;
    std::nth_element(c + lo, c + mid, c + hi, std::greater<float>());  // c[lo : mid) the largest
    double upper = 0.0;
    for (int64_t i = lo; i < mid; ++i) upper += c[i];
    if (upper >= needed) {
      hi = mid;  // the cut is among them
    } else {
      needed -= upper;  // all of them kept
      lo = mid;
    }
  }
  std::sort(c + lo, c + hi, std::greater<float>());
  double before = 0.0;
  int64_t kept = lo;  // a token stays while those before it hold less than needed: c[lo] always
  while (kept < hi && before < needed) before += c[kept++];
  return c[kept - 1];
}

// One row's floor: its k likeliest values (all, without a top-k), then the least of them that top-p
// keeps (top-p over their sum under a top-k, else the row's).
float row_floor(const float* row, int64_t V, int64_t top_k, float top_p, std::vector<float>& candidates) {
  const bool limited = top_k > 0, nucleus = top_p < 1.0f;
  if (!limited && !nucleus) return 0.0f;  // every token stays
  const int64_t k = limited ? std::min(top_k, V) : V;
  candidates.resize(V);
  float* c = candidates.data();
  Candidates found;
  for (const float floor : kCandidateFloors) {
    found = collect(row, V, floor, c);
    if (limited ? found.count >= k : found.mass >= top_p * found.total) break;
  }
  const int64_t n = std::min(k, found.count);
  if (n == 0) return 0.0f;  // a row of NaNs: no cut to make
  double norm = found.total;
  if (limited) {
    std::nth_element(c, c + n - 1, c + found.count, std::greater<float>());  // c[0 : n) the top k
    if (!nucleus) return c[n - 1];
    norm = 0.0;
    for (int64_t i = 0; i < n; ++i) norm += c[i];
  }
  return nucleus_floor(c, n, top_p * norm);
}

}  // namespace

at::Tensor kept_floor(const at::Tensor& probs, const at::Tensor& top_k, const at::Tensor& top_p) {
  TORCH_CHECK(probs.dim() == 2 && probs.is_contiguous() && probs.scalar_type() == at::kFloat,
              "kept_floor: contiguous float32 probs [rows, vocab]");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_p.scalar_type() == at::kFloat && top_k.numel() == probs.size(0) &&
                  top_p.numel() == probs.size(0),
              "kept_floor: int64 top_k and float32 top_p, one per row");
  const int64_t rows = probs.size(0), V = probs.size(1);
  const auto k = top_k.contiguous(), p = top_p.contiguous();
  auto out = at::empty({rows, 1}, probs.options());
  const float* data = probs.data_ptr<float>();
  const int64_t* ks = k.data_ptr<int64_t>();
  const float* ps = p.data_ptr<float>();
  float* floors = out.data_ptr<float>();
  parallel_chunks(rows, 1, [&](int64_t first, int64_t last) {
    std::vector<float> candidates;
    for (int64_t r = first; r < last; ++r) floors[r] = row_floor(data + r * V, V, ks[r], ps[r], candidates);
  });
  return out;
}
