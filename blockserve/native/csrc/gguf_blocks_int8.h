// gguf_blocks_int8.cpp's kernel for one GGUF format, for callers that round x once and dot it with the
// rows of many weights (moe_experts.cpp's experts: a token's input with each of its experts' rows):
//
//   arrange(x [M, K] float32) -> uint8 [M, row bytes]: x's rows rounded to int8 per block of 32
//       (block_levels.h) and laid out as the format's weights; rows may be gathered (index_select)
//   dot(w, row_bytes, K, begin, end, arranged x, M, N, out): out[m * N + n] = weight row n (of w, in
//       the format, row_bytes apart) . x's row m, for n in [begin, end) and the M rows of x
//
// Each output is the bits gguf_matmul_int8 gives for the same weight row and row of x. Kernels with
// the same `layout` take the same arranged rows.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace blockserve {

struct GgufInt8Kernel {
  const void* layout;
  int64_t elems, bytes;  // values and bytes per block of the format
  at::Tensor (*arrange)(const at::Tensor& x);
  void (*dot)(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t begin, int64_t end, const uint8_t* x,
              int64_t M, int64_t N, float* out);
};

// The kernel of GGUF `format` (an error naming the formats read for another).
GgufInt8Kernel gguf_int8_kernel(const std::string& format);

}  // namespace blockserve
