// Float32 activations as integers, so that the integer-dot kernels can multiply them without
// rounding them to 8 bits: per block of 32 values, with e the exponent of the block's largest
// magnitude (max|x| < 2^e) and u = 2^(e - 30),
//
//   X = round-to-nearest-even(x / u),  |X| <= 2^30,  X = L0 + 255 L1 + 255^2 L2 + 255^3 L3
//
// with balanced base-255 digits L_k in [-127, 127] (int8 levels, as the integer kernels' own, that
// they multiply without overflow or saturation), limb k's scale u * 255^k (exact in float32). Since u
// is a power of two, x / u is exact and every value within 1/128 of the block's largest magnitude is
// represented exactly (its float32 ulp is at least u); smaller ones are off by at most u / 2 = 2^-31
// of 2^e. So the sum over the four limbs' dot products is x @ W^T to float32 rounding: float32
// activations, not a quantisation of them.
//
// Limits: a block whose largest magnitude is below 2^-97 takes u = 2^-126 (an absolute error under
// 2^-127); a NaN or an infinity makes every limb's scale NaN, so the outputs are NaN, as x @ W^T's
// would be inf or NaN. AVX2 instructions.
#pragma once

#include "block_levels.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace blockserve {

constexpr int kLimbs = 4;
constexpr int kLimbBase = 255;

// `blocks` blocks of 32 values of x -> per limb (index 0 the most significant, L3): its levels r[limb]
// (32 per block), scales s[limb] and s * sum(levels) xsum[limb].
inline void limb_blocks(const float* x, int64_t blocks, int8_t* const r[kLimbs], float* const s[kLimbs],
                        float* const xsum[kLimbs]) {
  constexpr int64_t kBlock = 32;
  const __m256d inverse_base = _mm256_set1_pd(1.0 / kLimbBase);
  const __m256i base = _mm256_set1_epi32(kLimbBase);
  for (int64_t b = 0; b < blocks; ++b, x += kBlock) {
    __m256 v[4];
    __m256 unordered = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + 8 * k);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
    }
    const float amax = block_max_abs(v);
    const bool finite = !_mm256_movemask_ps(unordered) && std::isfinite(amax);
    int e = 0;
    if (finite && amax > 0.f) std::frexp(amax, &e);  // amax < 2^e
    if (e < -96) e = -96;
    const __m256 inv = _mm256_set1_ps(finite ? std::ldexp(1.f, 30 - e) : 0.f);  // exact: a power of two
    float scale = finite ? std::ldexp(1.f, e - 30) : std::numeric_limits<float>::quiet_NaN();
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
    for (int limb = kLimbs - 1; limb >= 0; --limb, scale *= kLimbBase) {  // the least significant digit first
      __m256i d[4];
      for (int k = 0; k < 4; ++k) {
        // quotient = round(q / 255) (q / 255 is never a half: 255 is odd), digit = q - 255 quotient
        const __m128i lo = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(q[k])), inverse_base));
        const __m128i hi = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(q[k], 1)), inverse_base));
        const __m256i quotient = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        d[k] = _mm256_sub_epi32(q[k], _mm256_mullo_epi32(quotient, base));
        q[k] = quotient;
      }
      store_int8_levels(d, r[limb] + b * kBlock);
      s[limb][b] = scale;
      xsum[limb][b] = scale * static_cast<float>(sum_levels(d));
    }
  }
}

}  // namespace blockserve
