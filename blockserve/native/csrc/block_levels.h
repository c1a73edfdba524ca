// Activations rounded per block of 32 to integer levels, as the integer-activation kernels take them
// (quantized_matmul.cpp's quantized_matmul_int8 / _int16, gguf_blocks_int8.cpp's gguf_matmul_int8);
// models/quantized_linear.py's round_per_block is the same function in torch (tests compare the bits):
//   s = max|x_b| / L,  r = round-to-nearest-even(x_b * (L / max|x_b|)),  x_b ~ s * r
// with L = 127 (int8 levels) or 32767 (int16). AVX2 instructions (what AVX-512 builds run too).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace blockserve {

template <typename Level> constexpr float kLevels = sizeof(Level) == 1 ? 127.f : 32767.f;

// The largest magnitude of a block's 32 values v[0..3] (a NaN among them is dropped by max_ps).
inline float block_max_abs(const __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}

// A block's 32 int32 levels q[0..3] (each within int8) stored as int8 at r, in order.
inline void store_int8_levels(const __m256i q[4], int8_t* r) {
  // packs interleave the 128-bit halves: dwords come out as 0-3 of q0, q1, q2, q3, then 4-7 of each
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(r),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The sum of a block's 32 int32 levels q[0..3].
inline int32_t sum_levels(const __m256i q[4]) {
  const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4e));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xb1));
  return _mm_cvtsi128_si32(sum4);
}

// `blocks` blocks of 32 values of x -> their levels r, scales s and s * sum(levels) (xsum).
template <typename Level>
void quantize_blocks(const float* x, int64_t blocks, Level* r, float* s, float* xsum) {
  constexpr int64_t kBlock = 32;
  for (int64_t b = 0; b < blocks; ++b, x += kBlock) {
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
    const float amax = block_max_abs(v);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? kLevels<Level> / amax : 0.f);
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  // rounds to nearest even
    if constexpr (sizeof(Level) == 1) {
      store_int8_levels(q, r + b * kBlock);
    } else {
      // words come out as 0-3 of q0, 0-3 of q1, 4-7 of q0, 4-7 of q1: qwords in the order 0, 2, 1, 3
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + b * kBlock + 16 * h),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xd8));
    }
    // A NaN in the block would vanish from amax (max_ps drops it) and from the levels: make the
    // scale NaN so the outputs are NaN, as x @ W^T's would be (an infinity gives inf or NaN by itself).
    __m256 nan = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
    s[b] = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : amax / kLevels<Level>;
    xsum[b] = s[b] * static_cast<float>(sum_levels(q));
  }
}

}  // namespace blockserve
