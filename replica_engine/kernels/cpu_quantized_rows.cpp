// A quantized token embedding's lookup: rows of a weight kept quantized, dequantized as
// quantized_weight.dequantize_rows computes them.
#include "cpu_linear.h"
#include "cpu_quantized_format.h"
#include "parallel.h"
#include "tensor.h"

namespace {

using quantized::dequantize_row;
using quantized::kCols;

// Rows row_ids[0 : R) of W dequantized into y [R, K], threads taking 64 rows at a time.
template <int kBits, int64_t kGroup, typename Out>
void dequantize_rows_of(const uint8_t* codes, const at::Half* scales, const int64_t* row_ids, int64_t R, int64_t K,
                        Out* y) {
  parallel_chunks(R, 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) dequantize_row<kBits, kGroup>(codes, scales, row_ids[r], K, y + r * K);
  });
}

}  // namespace

at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& ids, int64_t N,
                           int64_t K, int64_t bits, int64_t group, bool bfloat16_out) {
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && codes.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kHalf,
              "dequantize_rows: contiguous uint8 codes and float16 scales");
  const int64_t blocks = (N + kCols - 1) / kCols;
  TORCH_CHECK(K % 32 == 0 && codes.numel() == blocks * K * kCols * bits / 8 &&
                  scales.numel() == blocks * (K / group) * 2 * kCols,
              "dequantize_rows: codes and scales do not match N and K");
  const auto rows = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t R = rows.numel();
  const auto* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < N, "dequantize_rows: a row out of range");
  auto out = at::empty({R, K}, codes.options().dtype(bfloat16_out ? at::kBFloat16 : at::kFloat));
  const auto* c = codes.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<at::Half>();
  const auto run = [&](auto* y) {
    if (bits == 4 && group == 32) dequantize_rows_of<4, 32>(c, s, row_ids, R, K, y);
    else if (bits == 8 && group == 32) dequantize_rows_of<8, 32>(c, s, row_ids, R, K, y);
    else if (bits == 8 && group == 16) dequantize_rows_of<8, 16>(c, s, row_ids, R, K, y);
    else TORCH_CHECK(false, "dequantize_rows: no kernel for ", bits, "-bit codes in groups of ", group);
  };
  if (bfloat16_out) run(out.data_ptr<at::BFloat16>());
  else run(out.data_ptr<float>());
  return out;
}
