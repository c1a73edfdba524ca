// MXFP4 weights (OCP microscaling: gpt-oss's experts) read in place, in the Hugging Face
// checkpoint's layout, never widened whole:
//
//   blocks uint8 [N, K/32, 16]   32 e2m1 values per block, two a byte, the low nibble first
//   scales uint8 [N, K/32]       one e8m0 exponent per block: the block's values times 2^(s - 127)
//
//   mxfp4_matmul(x [M, K] float32, blocks, scales) -> out [M, N] = x @ W^T, W [N, K]:
//       x's columns are first reordered within each block of 32 (the even ones, then the odd ones),
//       so a byte's two nibbles land 16 apart; each output row is then dequantised once, in that
//       order, into a per-task buffer of K floats (L1/L2) and dotted with the M reordered rows
//       (row_dot.h). The weights are read from memory at their file size. From kTileRows rows
//       of x on, tiles of kTile output rows are dequantised instead and multiplied by ATen's
//       matmul (its blocked GEMM beats one row at a time once the weights are reused that often).
//
// Rows are dequantised by mxfp4_row.h (shared with moe_experts.cpp); every dequantised value (an
// e2m1 value times a power of two) is exact in float32, so the result is a float32 matmul over
// transformers' dequantised weights up to the order of the sums. The work runs on the process's
// TaskPool over ranges of output rows.

#include "kernels.h"

#include "mxfp4_row.h"
#include "row_dot.h"
#include "task_pool.h"

#include <algorithm>
#include <vector>

namespace blockserve {
namespace {

using mxfp4::kBlock;
using mxfp4::dequantize_row;
using mxfp4::split_even_odd;

constexpr int64_t kTileRows = 16;  // rows of x from which the tiled path runs (measured: benchmarks/mxfp4_matmul.py)
constexpr int64_t kTile = 256;     // output rows dequantised per tile

}  // namespace

at::Tensor mxfp4_matmul(at::Tensor x, at::Tensor blocks, at::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "mxfp4_matmul: x must be float32 [M, K]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == kBlock / 2 &&
                  blocks.is_contiguous(),
              "mxfp4_matmul: blocks must be contiguous uint8 [N, K/32, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(0) == blocks.size(0) && scales.size(1) == blocks.size(1),
              "mxfp4_matmul: scales must be contiguous uint8 [N, K/32], as blocks' first two dimensions");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), groups = blocks.size(1);
  TORCH_CHECK(K == groups * kBlock, "mxfp4_matmul: x has ", K, " columns but the blocks hold ", groups * kBlock);
  x = split_even_odd(x.contiguous());
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const uint8_t* s = scales.data_ptr<uint8_t>();
  if (M >= kTileRows) {
    auto tile = at::empty({std::min(kTile, N), K}, x.options());
    float* t = tile.data_ptr<float>();
    for (int64_t n0 = 0; n0 < N; n0 += kTile) {
      const int64_t rows = std::min(kTile, N - n0);
      for_each_range(rows, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n)
          dequantize_row(w + (n0 + n) * groups * (kBlock / 2), s + (n0 + n) * groups, groups, t + n * K);
      });
      out.narrow(1, n0, rows).copy_(at::mm(x, tile.narrow(0, 0, rows).t()));
    }
    return out;
  }
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
