// RoPE in Hugging Face's rotate_half layout on the heads of one token, in place: for each of
// `heads` heads of `head_dim` floats at x, with halves x1, x2 and cos, sin [head_dim / 2]:
//     x1' = x1 cos - x2 sin        x2' = x2 cos + x1 sin
#pragma once

#include <cstdint>

static inline void rotate_half_heads(float* x, int64_t heads, int64_t head_dim, const float* __restrict c,
                                     const float* __restrict s) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* __restrict x1 = x + h * head_dim;
    float* __restrict x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * c[i] - b * s[i];
      x2[i] = b * c[i] + a * s[i];
    }
  }
}
