// One MXFP4 weight row (the Hugging Face checkpoint's layout, mxfp4.cpp's header) dequantised into a
// buffer of floats, for the kernels that dot it with a few rows of x (mxfp4.cpp, moe_experts.cpp):
//
//   dequantize_row(blocks, scales, groups, out)   each block's low nibbles (its even columns), then
//                                                 its high ones: 32 floats a block, exact in float32
//   split_even_odd(x [M, K])                      x's columns in that order, so a dot matches
//
// The e2m1 table is one register. AVX-512: 16 nibbles widened to int32 index it with vpermps; AVX2:
// 8 at a time, the magnitude from an 8-entry table and the sign from the nibble's top bit;
// otherwise a scalar table lookup.

#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace blockserve {
namespace mxfp4 {

inline constexpr int64_t kBlock = 32;  // values per block (one scale)
inline constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float e8m0(uint8_t s) { return s == 255 ? NAN : std::ldexp(1.0f, int(s) - 127); }

// One row's blocks as floats, each block's low nibbles (its even columns) then its high ones.
inline void dequantize_row(const uint8_t* blocks, const uint8_t* scales, int64_t groups, float* out) {
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512i low = _mm512_set1_epi32(0x0f);
#elif defined(__AVX2__)
  const __m256 magnitudes = _mm256_loadu_ps(kE2M1);
  const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8), low = _mm256_set1_epi32(0x0f);
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const float d = e8m0(scales[g]);
    const uint8_t* q = blocks + g * (kBlock / 2);
    float* y = out + g * kBlock;
#if defined(__AVX512F__)
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512 scale = _mm512_set1_ps(d);
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(bytes, low), table), scale));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table), scale));
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(d);
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * half)));
      const __m256i nibbles[2] = {_mm256_and_si256(bytes, low), _mm256_srli_epi32(bytes, 4)};
      for (int hi = 0; hi < 2; ++hi) {
        const __m256 magnitude = _mm256_permutevar8x32_ps(magnitudes, _mm256_and_si256(nibbles[hi], seven));
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(nibbles[hi], eight), 28));
        _mm256_storeu_ps(y + 16 * hi + 8 * half, _mm256_mul_ps(_mm256_xor_ps(magnitude, sign), scale));
      }
    }
#else
    for (int j = 0; j < kBlock / 2; ++j) {
      y[j] = kE2M1[q[j] & 0x0f] * d;
      y[j + kBlock / 2] = kE2M1[q[j] >> 4] * d;
    }
#endif
  }
}

// x [M, K] with each block of 32 columns as dequantize_row orders the weights: even, then odd.
inline at::Tensor split_even_odd(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  return x.view({M, K / kBlock, kBlock / 2, 2}).transpose(2, 3).contiguous().view({M, K});
}

}  // namespace mxfp4
}  // namespace blockserve
