// Vector pieces the GGUF block kernels (gguf_blocks.cpp) are built from, for the AVX-512 and the
// AVX2 build alike: the bytes of a block are unpacked 16 at a time in 128-bit registers (SSSE3,
// present in both), then widened to float32 at the build's width.
//
//   store_scaled(q, d, y)          y[0..16) = d * q            (q: 16 int8)
//   store_scaled_less(q, d, m, y)  y[0..16) = d * q - m        (rounded after the product, as gguf-py)
//   store_scaled_plus(q, d, m, y)  y[0..16) = d * q + m        (likewise)
//   bit_bytes(bits)                0xff in byte j where bit j of the 16 low bits is set
//   low_nibbles / high_nibbles     the 4-bit halves of 16 bytes
//
// Each product and difference rounds on its own, as gguf-py's numpy arithmetic does
// (tests/models/test_gguf_block_linear.py compares the bits).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace blockserve {

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0f)); }

inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)); }

inline __m128i bit_bytes(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi16(int16_t(bits & 0xffff)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i select = _mm_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm_cmpeq_epi8(_mm_and_si128(spread, select), select);
}

#if defined(__AVX512F__)
inline __m512 widen16(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

inline void store_scaled(__m128i q, float d, float* y) { _mm512_storeu_ps(y, _mm512_mul_ps(widen16(q), _mm512_set1_ps(d))); }

inline void store_scaled_less(__m128i q, float d, float m, float* y) {
  const __m512 product = _mm512_mul_ps(widen16(q), _mm512_set1_ps(d));
  _mm512_storeu_ps(y, _mm512_sub_ps(product, _mm512_set1_ps(m)));
}

inline void store_scaled_plus(__m128i q, float d, float m, float* y) {
  const __m512 product = _mm512_mul_ps(widen16(q), _mm512_set1_ps(d));
  _mm512_storeu_ps(y, _mm512_add_ps(product, _mm512_set1_ps(m)));
}
#else
inline __m256 widen8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

inline void store_scaled(__m128i q, float d, float* y) {
  const __m256 vd = _mm256_set1_ps(d);
  _mm256_storeu_ps(y, _mm256_mul_ps(widen8(q), vd));
  _mm256_storeu_ps(y + 8, _mm256_mul_ps(widen8(_mm_unpackhi_epi64(q, q)), vd));
}

inline void store_scaled_less(__m128i q, float d, float m, float* y) {
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  _mm256_storeu_ps(y, _mm256_sub_ps(_mm256_mul_ps(widen8(q), vd), vm));
  _mm256_storeu_ps(y + 8, _mm256_sub_ps(_mm256_mul_ps(widen8(_mm_unpackhi_epi64(q, q)), vd), vm));
}

inline void store_scaled_plus(__m128i q, float d, float m, float* y) {
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  _mm256_storeu_ps(y, _mm256_add_ps(_mm256_mul_ps(widen8(q), vd), vm));
  _mm256_storeu_ps(y + 8, _mm256_add_ps(_mm256_mul_ps(widen8(_mm_unpackhi_epi64(q, q)), vd), vm));
}
#endif

}  // namespace blockserve
