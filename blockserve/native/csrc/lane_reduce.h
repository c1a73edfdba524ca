// Horizontal sums and maxima of SIMD lanes for the decode attention kernels (paged_decode*.cpp)
// and the quantized matmul (quantized_matmul.cpp):
// lanes_transpose_sumN(v) puts the sum of v[j]'s lanes in lane j (N vectors reduced at once),
// lanes_reduce_add<N> in _mm512_reduce_add_ps's order (the quantized matmul's outputs);
// lanes_add8_each<N> as the quantized matmul's AVX2 path sums them; lanes_max8 and lanes_add8 reduce
// one AVX2 vector.
#pragma once

#include <immintrin.h>

#if defined(__AVX512F__)
// Lane n: the sum of v[n]'s lanes, N <= 16 vectors at once (the absent ones zero): halves, then
// quarters, then pairs of lanes added across vectors (8 + 4 + 2 + 1 shuffle pairs instead of N
// separate reductions), the pairs taken by the two shuffle immediates Pair / PairOther; the last add
// leaves vector 4m + k's sum in lane 4k + m, which the final permute undoes.
template <int N, int Pair, int PairOther>
static inline __m512 lanes_sums(const __m512* v) {
  static_assert(N >= 1 && N <= 16);
  const auto at = [&](int i) { return i < N ? v[i] : _mm512_setzero_ps(); };
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = 2 * i < N ? _mm512_add_ps(_mm512_shuffle_f32x4(at(2 * i), at(2 * i + 1), 0x44),
                                     _mm512_shuffle_f32x4(at(2 * i), at(2 * i + 1), 0xEE))
                     : _mm512_setzero_ps();
  for (int i = 0; i < 4; ++i)
    b[i] = 4 * i < N ? _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                                     _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD))
                     : _mm512_setzero_ps();
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], Pair), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], PairOther));
  const __m512 mixed = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), mixed);
}

// Lane n: v[n]'s lanes summed (16 vectors; the third step adds neighbouring lanes).
static inline __m512 lanes_transpose_sum16(const __m512* v) { return lanes_sums<16, 0x88, 0xDD>(v); }

// Lane n: v[n]'s lanes summed as _mm512_reduce_add_ps sums them, to the bit (lanes j and j + 8, then
// j and j + 4, then j and j + 2, then 0 and 1), for N <= 16 vectors at once.
template <int N>
static inline __m512 lanes_reduce_add(const __m512* v) { return lanes_sums<N, 0x44, 0xEE>(v); }
#endif

#if defined(__AVX2__)
// Two rounds of pairwise adds within 128-bit halves (hadd), then the halves added across.
static inline __m256 lanes_transpose_sum8(const __m256* v) {
  const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20), _mm256_permute2f128_ps(first, second, 0x31));
}

// Lane n: v[n]'s lanes summed as the quantized matmul's AVX2 path sums them (lanes j and j + 4, then
// neighbours, then the pairs' sums), for N <= 8 vectors at once (the absent ones zero).
template <int N>
static inline __m256 lanes_add8_each(const __m256* v) {
  static_assert(N >= 1 && N <= 8);
  const auto at = [&](int i) { return i < N ? v[i] : _mm256_setzero_ps(); };
  __m256 s[4];  // [v[2p]'s lanes j + (j + 4) | v[2p + 1]'s]
  for (int i = 0; i < 4; ++i)
    s[i] = 2 * i < N ? _mm256_add_ps(_mm256_permute2f128_ps(at(2 * i), at(2 * i + 1), 0x20),
                                     _mm256_permute2f128_ps(at(2 * i), at(2 * i + 1), 0x31))
                     : _mm256_setzero_ps();
  const __m256 pairs_low = _mm256_hadd_ps(s[0], s[1]), pairs_high = _mm256_hadd_ps(s[2], s[3]);
  return _mm256_permutevar8x32_ps(_mm256_hadd_ps(pairs_low, pairs_high), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline float lanes_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float lanes_add8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
#endif
