// Prompt-chunk attention in bfloat16 with the CPU's pairwise dot product (AVX512-BF16, D a
// multiple of 32): one task's query rows (cpu_prefill_attention.cpp splits a step's chunks into
// tasks) against one KV head's keys, in blocks of kKeyBlock keys: the block's scores for every
// row of the task (S = Q K^T, held in L2), each row's softmax over the block at once (one max and
// one rescale of its output per block, where a 16-key online softmax paid both every 16 keys),
// then P.V. QK^T and P.V are register tiles of up to 8 rows by 32 keys and up to 6 rows by D, so
// each loaded key, value or query word meets several rows or keys. Keys are transposed as k pairs
// (kt: word j of 16 keys, one vector), values paired by key (vt: keys 2p and 2p + 1 at the d of
// word w, in unpacklo/unpackhi order); scores take the scale after the dot products (the bfloat16
// query as it is); probabilities meet the values rounded to bfloat16, as flash attention's P.V does.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention.h"
#include "simd.h"

#ifdef __AVX512BF16__
namespace {

constexpr int64_t kKeyBlock = 128;

struct BlockScratch {  // a thread's, grown once: the task's rows and one key block
  std::vector<uint32_t> q;   // [n][D / 2] query words
  std::vector<float> acc;    // [n][D] output rows, in vt's word order
  std::vector<float> kt;     // [tile][D / 2][16]
  std::vector<float> vt;     // [pair][D / 32 * 2][16]
  std::vector<float> s;      // [n][kKeyBlock] scores
  std::vector<uint16_t> p;   // [n][kKeyBlock] probabilities, bfloat16 bits
  std::vector<float> row_max, row_sum, correction;
  std::vector<int64_t> visible;  // [n] keys of the block the row sees
  void fit(int64_t n, int64_t D) {
    const auto grow = [](auto& v, int64_t size) { if (static_cast<int64_t>(v.size()) < size) v.resize(size); };
    grow(q, n * D / 2), grow(acc, n * D), grow(kt, kKeyBlock * D / 2), grow(vt, kKeyBlock * D / 2);
    grow(s, n * kKeyBlock), grow(p, n * kKeyBlock);
    grow(row_max, n), grow(row_sum, n), grow(correction, n), grow(visible, n);
  }
};

// The calling thread's scratch. Not inlined: a thread_local's address, looked up where the
// kernels use it, is a call that spills every register holding an accumulator.
__attribute__((noinline)) BlockScratch& thread_scratch() {
  thread_local BlockScratch scratch;
  return scratch;
}

inline __m512bh word_at(const float* base, int64_t i) { return (__m512bh)_mm512_loadu_ps(base + 16 * i); }
inline __m512bh broadcast_word(const void* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return (__m512bh)_mm512_set1_epi32(word);
}

// Scores of rows [i0, i0 + R) against kT key tiles from `tile`, times scale, into s.
template <int64_t kWords, int64_t R, int64_t kT>
inline void score_tiles(BlockScratch& scratch, int64_t i0, int64_t tile, float scale) {
  __m512 acc[R][kT];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < kT; ++t) acc[r][t] = _mm512_setzero_ps();
  const float* kt = scratch.kt.data() + tile * kWords * 16;
  const uint32_t* q = scratch.q.data() + i0 * kWords;
  for (int64_t j = 0; j < kWords; ++j) {
    __m512bh k[kT];
    for (int64_t t = 0; t < kT; ++t) k[t] = word_at(kt, t * kWords + j);
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh qw = broadcast_word(q + r * kWords + j);
      for (int64_t t = 0; t < kT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], k[t], qw);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < kT; ++t) {
      float* s = &scratch.s[(i0 + r) * kKeyBlock + (tile + t) * 16];
      _mm512_storeu_ps(s, _mm512_mul_ps(acc[r][t], _mm512_set1_ps(scale)));
    }
}

// Row i's softmax over the block's first `visible` keys, merged into its running max and sum;
// its probabilities (0 past `visible`, up to the block's `tiles` * 16) as bfloat16 into p.
inline void row_probabilities(BlockScratch& scratch, int64_t i, int64_t tiles) {
  const int64_t visible = scratch.visible[i];
  uint16_t* p = scratch.p.data() + i * kKeyBlock;
  const auto store = [&](int64_t t, __m512 e) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t * 16), (__m256i)_mm512_cvtneps_pbh(e));
  };
  scratch.correction[i] =
      block_softmax(scratch.s.data() + i * kKeyBlock, visible, scratch.row_max[i], scratch.row_sum[i], store);
  std::fill(p + (visible + 15) / 16 * 16, p + tiles * 16, 0);
}

// Rows [i0, i0 + R): output rescaled by the block's correction, plus P.V over `pairs` key pairs.
template <int64_t kDV, int64_t R>
inline void add_values(BlockScratch& scratch, int64_t i0, int64_t pairs) {
  constexpr int64_t D = kDV * 16;
  __m512 o[R][kDV];
  for (int64_t r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(scratch.correction[i0 + r]);
    for (int64_t v = 0; v < kDV; ++v) o[r][v] = _mm512_mul_ps(_mm512_loadu_ps(&scratch.acc[(i0 + r) * D + v * 16]), c);
  }
  const float* vt = scratch.vt.data();
  const uint16_t* p = scratch.p.data() + i0 * kKeyBlock;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    __m512bh values[kDV];
    for (int64_t v = 0; v < kDV; ++v) values[v] = word_at(vt, pair * kDV + v);
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh pp = broadcast_word(p + r * kKeyBlock + 2 * pair);
      for (int64_t v = 0; v < kDV; ++v) o[r][v] = _mm512_dpbf16_ps(o[r][v], values[v], pp);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kDV; ++v) _mm512_storeu_ps(&scratch.acc[(i0 + r) * D + v * 16], o[r][v]);
}

template <int64_t kDV>
void attend_rows(const PromptChunk& chunk, int64_t row0, int64_t rows, int64_t g, const at::BFloat16* q,
                 const at::BFloat16* k_cache, const at::BFloat16* v_cache, at::BFloat16* out, int64_t H, int64_t G,
                 int64_t block_size, int64_t KVH, float scale) {
  constexpr int64_t D = kDV * 16, kWords = D / 2, kChunks = D / 32;  // a chunk: 32 values, 16 words
  constexpr int64_t kValueRows = std::clamp<int64_t>(24 / kDV, 1, 6);  // P.V accumulators in registers
  BlockScratch& scratch = thread_scratch();
  const int64_t n = G * rows, kv_stride = KVH * D;  // row i: token row0 + i / G, head g * G + i % G
  scratch.fit(n, D);
  auto q_row = [&](int64_t i) { return q + ((chunk.first_row + row0 + i / G) * H + g * G + i % G) * D; };
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(&scratch.q[i * kWords], q_row(i), D * sizeof(at::BFloat16));
    std::fill_n(&scratch.acc[i * D], D, 0.f);
    scratch.row_max[i] = -std::numeric_limits<float>::infinity();
    scratch.row_sum[i] = 0.f;
  }
  // Query row j of the chunk sits at position kv_len - num_rows + j and sees keys up to it.
  const int64_t first_pos = chunk.kv_len - chunk.num_rows + row0, keys = first_pos + rows;
  int64_t offsets[kKeyBlock];  // of the block's keys in a cache
  for (int64_t start = 0; start < keys; start += kKeyBlock) {
    const int64_t tokens = std::min(kKeyBlock, keys - start), tiles = (tokens + 15) / 16;
    paged_offsets(chunk.table, block_size, kv_stride, start, tokens, offsets);
    for (int64_t i = 0; i < n; ++i) scratch.visible[i] = std::clamp<int64_t>(first_pos + i / G + 1 - start, 0, tokens);
    const auto row_chunk = [&](const at::BFloat16* cache, int64_t t, int64_t c) {
      return t < tokens ? _mm512_loadu_si512(cache + offsets[t] + g * D + c * 32) : _mm512_setzero_si512();
    };
    for (int64_t tile = 0; tile < tiles; ++tile) {
      for (int64_t c = 0; c < kChunks; ++c) {
        __m512 block[16];
        for (int64_t t = 0; t < 16; ++t) block[t] = _mm512_castsi512_ps(row_chunk(k_cache, tile * 16 + t, c));
        transpose16(block);
        for (int64_t j = 0; j < 16; ++j) _mm512_storeu_ps(&scratch.kt[((tile * kWords) + c * 16 + j) * 16], block[j]);
        for (int64_t pair = tile * 8; pair < tile * 8 + 8; ++pair) {
          const __m512i a = row_chunk(v_cache, 2 * pair, c), b = row_chunk(v_cache, 2 * pair + 1, c);
          _mm512_storeu_si512(&scratch.vt[(pair * kDV + 2 * c) * 16], _mm512_unpacklo_epi16(a, b));
          _mm512_storeu_si512(&scratch.vt[(pair * kDV + 2 * c + 1) * 16], _mm512_unpackhi_epi16(a, b));
        }
      }
    }
    // A group's rows see no more keys than its last one (positions grow with i).
    const auto group_tiles = [&](int64_t last) { return (scratch.visible[last] + 15) / 16; };
    row_groups<8>(n, [&](int64_t i0, auto group) {
      constexpr int64_t R = decltype(group)::value;
      const int64_t needed = group_tiles(i0 + R - 1);
      int64_t tile = 0;
      for (; tile + 2 <= needed; tile += 2) score_tiles<kWords, R, 2>(scratch, i0, tile, scale);
      if (tile < needed) score_tiles<kWords, R, 1>(scratch, i0, tile, scale);
      for (int64_t i = i0; i < i0 + R; ++i) row_probabilities(scratch, i, tiles);
    });
    row_groups<kValueRows>(n, [&](int64_t i0, auto group) {
      constexpr int64_t R = decltype(group)::value;
      add_values<kDV, R>(scratch, i0, (scratch.visible[i0 + R - 1] + 1) / 2);
    });
  }
  for (int64_t i = 0; i < n; ++i) {  // word w of vector 2c (unpacklo) is d = 32c + 8(w / 4) + w % 4; 2c+1: + 4
    const float inv = scratch.row_sum[i] > 0.f ? 1.f / scratch.row_sum[i] : 0.f;
    const float* acc = scratch.acc.data() + i * D;
    alignas(64) float row[D];
    for (int64_t v = 0; v < kDV; ++v)
      for (int64_t w = 0; w < 16; ++w) row[(v / 2) * 32 + (w / 4) * 8 + (v % 2) * 4 + w % 4] = acc[v * 16 + w] * inv;
    at::BFloat16* dst = out + ((chunk.first_row + row0 + i / G) * H + g * G + i % G) * D;
    for (int64_t v = 0; v < kDV; ++v) store16(dst + v * 16, _mm512_load_ps(row + v * 16));
  }
}

// attend_rows for this head_dim: one instantiation per multiple of 32 up to 256.
template <int64_t kDV = 2>
auto rows_for_head_dim(int64_t D) {
  if constexpr (kDV < 16) {
    if (D != kDV * 16) return rows_for_head_dim<kDV + 2>(D);
  }
  return &attend_rows<kDV>;
}

}  // namespace

bool prompt_rows_bf16_supported(int64_t D) { return D % 32 == 0 && D <= 256; }

void attend_prompt_rows_bf16(const PromptChunk& chunk, int64_t row0, int64_t rows, int64_t g, const at::BFloat16* q,
                             const at::BFloat16* k_cache, const at::BFloat16* v_cache, at::BFloat16* out, int64_t H,
                             int64_t D, int64_t G, int64_t block_size, int64_t KVH, float scale) {
  rows_for_head_dim(D)(chunk, row0, rows, g, q, k_cache, v_cache, out, H, G, block_size, KVH, scale);
}
#else
bool prompt_rows_bf16_supported(int64_t) { return false; }

void attend_prompt_rows_bf16(const PromptChunk&, int64_t, int64_t, int64_t, const at::BFloat16*, const at::BFloat16*,
                             const at::BFloat16*, at::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t, float) {
  __builtin_trap();  // never called: prompt_rows_bf16_supported says no
}
#endif
