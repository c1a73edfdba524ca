// One dequantised weight row dotted with M rows of x, for the kernels that dequantise a row of
// packed weights into a small buffer first (mxfp4.cpp). The vector code is the
// compiler's, at the build's width.

#pragma once

#include <cstdint>

namespace blockserve {

// Four rows of x against one dequantised output row at a time: the weights are loaded once per four dots.
inline void dot_rows(const float* w, const float* x, int64_t M, int64_t K, float* out, int64_t out_stride) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    const float* x0 = x + m * K;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < K; ++k) {
      s0 += w[k] * x0[k];
      s1 += w[k] * x0[K + k];
      s2 += w[k] * x0[2 * K + k];
      s3 += w[k] * x0[3 * K + k];
    }
    out[m * out_stride] = s0;
    out[(m + 1) * out_stride] = s1;
    out[(m + 2) * out_stride] = s2;
    out[(m + 3) * out_stride] = s3;
  }
  for (; m < M; ++m) {
    const float* xm = x + m * K;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += w[k] * xm[k];
    out[m * out_stride] = s;
  }
}

}  // namespace blockserve
