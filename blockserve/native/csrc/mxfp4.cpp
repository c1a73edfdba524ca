// MXFP4 weights (OCP microscaling: gpt-oss's experts) read in place, in the Hugging Face
// checkpoint's layout, never widened whole:
//
//   blocks uint8 [N, K/32, 16]   32 e2m1 values per block, two a byte, the low nibble first
//   scales uint8 [N, K/32]       one e8m0 exponent per block: the block's values times 2^(s - 127)
//
//   mxfp4_matmul(x [M, K] float32, blocks, scales) -> out [M, N] = x @ W^T, W [N, K]:
//       each output row is dequantised once into a per-task buffer of K floats (L1/L2) and dotted
//       with the M rows of x (row_dot.h), so the weights are read from memory at their file size.
//
// Every dequantised value (an e2m1 value times a power of two) is exact in float32, so the result
// is a float32 matmul over transformers' dequantised weights up to the order of the sums. The
// work runs on the process's TaskPool over ranges of output rows; the vector code is the
// compiler's (-march=native, or -mno-avx512f for the AVX2 build).

#include "kernels.h"

#include "row_dot.h"
#include "task_pool.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace blockserve {
namespace {

constexpr int64_t kBlock = 32;
constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float e8m0(uint8_t s) { return s == 255 ? NAN : std::ldexp(1.0f, int(s) - 127); }

void dequantize_row(const uint8_t* blocks, const uint8_t* scales, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float d = e8m0(scales[g]);
    const uint8_t* q = blocks + g * (kBlock / 2);
    float* y = out + g * kBlock;
    for (int j = 0; j < kBlock / 2; ++j) {
      y[2 * j] = kE2M1[q[j] & 0x0f] * d;
      y[2 * j + 1] = kE2M1[q[j] >> 4] * d;
    }
  }
}

}  // namespace

at::Tensor mxfp4_matmul(at::Tensor x, at::Tensor blocks, at::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "mxfp4_matmul: x must be float32 [M, K]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == kBlock / 2 &&
                  blocks.is_contiguous(),
              "mxfp4_matmul: blocks must be contiguous uint8 [N, K/32, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(0) == blocks.size(0) && scales.size(1) == blocks.size(1),
              "mxfp4_matmul: scales must be contiguous uint8 [N, K/32], as blocks' first two dimensions");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), groups = blocks.size(1);
  TORCH_CHECK(K == groups * kBlock, "mxfp4_matmul: x has ", K, " columns but the blocks hold ", groups * kBlock);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const uint8_t* s = scales.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // tasks of >= ~64 K multiply-adds
  for_each_range(N, std::max<int64_t>(1, (1 << 16) / (K * M)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      dequantize_row(w + n * groups * (kBlock / 2), s + n * groups, groups, row.data());
      dot_rows(row.data(), xp, M, K, o + n, N);
    }
  });
  return out;
}

}  // namespace blockserve
