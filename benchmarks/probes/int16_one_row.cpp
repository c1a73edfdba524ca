// A probe, not engine code: one row of x against SmolLM2's Q4_1 shapes (and a Q4_1 stand-in for
// the 49152-row LM head) in csrc/quantized_matmul.cpp's packed layout, on AVX2, one thread:
//   float32  the engine's one-row AVX2 pass (levels widened to float; group_avx2_all_outputs)
//   int16    x rounded per block of 32 to +-32767 levels, levels widened to 16 bits, vpmaddwd
// Medians of 5 rounds (each the best of 7 x 200 calls), and the largest output difference.
//
//   g++ -O3 -mavx2 -mfma -mno-avx512f -std=c++17 benchmarks/probes/int16_one_row.cpp -o /tmp/int16_probe
//   /tmp/int16_probe
//
// What 16-bit activations would do to the logprobs: benchmarks/chunking_drift.py --emulate-levels 32767.
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <algorithm>

constexpr int B = 32, G = 4, GB = 96;

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s); s = _mm_hadd_ps(s, s); return _mm_cvtss_f32(s);
}

void float_kernel(const float* x, const float* xsum, const uint8_t* w, float* out, int K, int N) {
  const int blocks = K / B; const __m256i low4 = _mm256_set1_epi32(15);
  for (int g = 0; g < N / G; ++g) {
    const uint8_t* gb = w + (size_t)g * blocks * GB;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 mn = _mm_setzero_ps();
    for (int b = 0; b < blocks; ++b, gb += GB) {
      _mm_prefetch((const char*)gb + 24 * GB, _MM_HINT_T0); _mm_prefetch((const char*)gb + 24 * GB + 64, _MM_HINT_T0);
      const float* xb = x + b * B;
      for (int i = 0; i < 4; ++i) {
        const uint8_t* q = gb + 32 + 16 * i;
        __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));
        __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, low4)), _mm256_loadu_ps(xb));
        dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, low4)), _mm256_loadu_ps(xb + 8), dot);
        dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_loadu_ps(xb + 16), dot);
        dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), _mm256_loadu_ps(xb + 24), dot);
        acc[i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(((const float*)gb)[i]), acc[i]);
      }
      mn = _mm_fmadd_ps(_mm_loadu_ps((const float*)(gb + 16)), _mm_set1_ps(xsum[b]), mn);
    }
    float m[4]; _mm_storeu_ps(m, mn);
    for (int i = 0; i < 4; ++i) out[g * 4 + i] = hsum(acc[i]) + m[i];
  }
}

// x as int16 per block: x ~ s * r, r in [-32767, 32767]; weights' levels widened to 16 bits.
// Layout of r per block: elements 0-15 then 16-31 (two 16-lane vectors), matching the nibbles.
void int16_kernel(const int16_t* r, const float* s, const float* xsum, const uint8_t* w, float* out, int K, int N) {
  const int blocks = K / B; const __m256i low4 = _mm256_set1_epi16(15);
  for (int g = 0; g < N / G; ++g) {
    const uint8_t* gb = w + (size_t)g * blocks * GB;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 mn = _mm_setzero_ps();
    for (int b = 0; b < blocks; ++b, gb += GB) {
      _mm_prefetch((const char*)gb + 24 * GB, _MM_HINT_T0); _mm_prefetch((const char*)gb + 24 * GB + 64, _MM_HINT_T0);
      const __m256i r_lo = _mm256_loadu_si256((const __m256i*)(r + b * B));
      const __m256i r_hi = _mm256_loadu_si256((const __m256i*)(r + b * B + 16));
      const __m256 sb = _mm256_set1_ps(s[b]);
      for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(gb + 32 + 16 * i)));
        const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_srli_epi16(q, 4);
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, r_lo), _mm256_madd_epi16(hi, r_hi));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_set1_ps(((const float*)gb)[i]), sb), acc[i]);
      }
      mn = _mm_fmadd_ps(_mm_loadu_ps((const float*)(gb + 16)), _mm_set1_ps(xsum[b]), mn);
    }
    float m[4]; _mm_storeu_ps(m, mn);
    for (int i = 0; i < 4; ++i) out[g * 4 + i] = hsum(acc[i]) + m[i];
  }
}

int main() {
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  for (auto [K, N] : {std::pair{576, 3072}, {1536, 576}, {576, 960}, {576, 49152}}) {
    const int blocks = K / B;
    std::vector<uint8_t> w((size_t)N / G * blocks * GB);
    for (auto& v : w) v = rng() & 0xff;
    for (size_t g = 0; g < w.size() / GB; ++g) { float* f = (float*)&w[g * GB]; for (int j = 0; j < 8; ++j) f[j] = nd(rng) * 0.01f; }
    std::vector<float> x(K), xsum(blocks), s(blocks); std::vector<int16_t> r(K);
    for (auto& v : x) v = nd(rng);
    for (int b = 0; b < blocks; ++b) {
      float mx = 0; for (int j = 0; j < B; ++j) mx = std::max(mx, std::fabs(x[b * B + j]));
      s[b] = mx / 32767.f; float sum = 0;
      for (int j = 0; j < B; ++j) { r[b * B + j] = (int16_t)std::lrint(x[b * B + j] / s[b]); sum += x[b * B + j]; }
      xsum[b] = sum;
    }
    std::vector<float> o1(N), o2(N);
    auto time = [&](auto fn) { double best = 1e9; for (int rep = 0; rep < 7; ++rep) { auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < 200; ++k) fn(); double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200; best = std::min(best, us);} return best; };
    std::vector<double> tf, ti;
    for (int round = 0; round < 5; ++round) {
      tf.push_back(time([&] { float_kernel(x.data(), xsum.data(), w.data(), o1.data(), K, N); }));
      ti.push_back(time([&] { int16_kernel(r.data(), s.data(), xsum.data(), w.data(), o2.data(), K, N); }));
    }
    std::sort(tf.begin(), tf.end()); std::sort(ti.begin(), ti.end());
    double maxrel = 0, scale = 0; for (int n = 0; n < N; ++n) { maxrel = std::max(maxrel, (double)std::fabs(o1[n] - o2[n])); scale = std::max(scale, (double)std::fabs(o1[n])); }
    printf("K %5d N %6d  float32 %8.1f us  int16 %8.1f us  %.2fx   max|diff| %.2e of max|out| %.2e\n", K, N, tf[2], ti[2], tf[2] / ti[2], maxrel, scale);
  }
}
