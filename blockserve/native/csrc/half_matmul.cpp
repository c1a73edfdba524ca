// out = x @ W^T with x float32 and W kept in 16 bits (bfloat16 or float16), as a checkpoint stores
// it: each weight is widened to float32 in registers and the products are summed in float32, so
// the result is the float32 matmul over the widened weights up to float rounding, read at 2 bytes
// per weight instead of 4. For the rows of a decode batch, where a matmul is bound by reading its
// weights (models/half_linear.py sends larger batches to a GEMM over converted tiles).
//
// Widening is exact for both formats: bfloat16 is the high half of a float32 (a 16-bit shift of
// the zero-extended bits), float16 is converted by F16C's vcvtph2ps (AVX-512F has a 16-lane form).
// AVX512-BF16's dot products are not used: they take both operands in bfloat16, so x would be
// rounded to 8 bits of mantissa.
//
// Layout: W [N, K] row-major (the checkpoint's), any N and K (a K tail past the vector width runs
// in scalar code). Output rows are taken kGroup at a time; for each group, the rows of x in passes
// of kRows, the group's weights staying in L1 across passes. Every output is the same arithmetic in
// the same order whatever M or the pass it falls in, so a row's result does not depend on what
// shares its call. An AVX-512 path (16 lanes) and an AVX2 + FMA + F16C one (8 lanes), chosen at
// compile time (-march=native); half_matmul_lanes() says which (0: neither, the kernel cannot run).

#include "kernels.h"

#include "task_pool.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX512F__)
#define BLOCKSERVE_HALF_LANES 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BLOCKSERVE_HALF_LANES 8
#else
#define BLOCKSERVE_HALF_LANES 0
#endif
#if BLOCKSERVE_HALF_LANES
#include <immintrin.h>
#endif

namespace blockserve {
namespace {

#if BLOCKSERVE_HALF_LANES
constexpr int64_t kLanes = BLOCKSERVE_HALF_LANES;
constexpr int kGroup = 4;                          // output rows per pass over x
constexpr int kRows = kLanes == 16 ? 4 : 2;        // rows of x per pass (accumulators: kGroup x kRows registers)

#if BLOCKSERVE_HALF_LANES == 16
using Vec = __m512;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum_lanes(Vec v) { return _mm512_reduce_add_ps(v); }
template <bool BF16>
inline Vec widen(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}
#else
using Vec = __m256;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum_lanes(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
template <bool BF16>
inline Vec widen(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}
#endif

template <bool BF16>
inline float widen_one(uint16_t h) {
  if constexpr (BF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return _cvtsh_ss(h);
  }
}

struct Problem {
  const float* x;     // [M, K]
  const uint16_t* w;  // [N, K]
  float* out;         // [M, N]
  int64_t M, K, N;
};

// Output rows n0..n0+G against rows r0..r0+R of x: each weight vector is widened once and used for
// the R rows; per output one float32 sum of kLanes partial sums, then the K tail in scalar code.
template <bool BF16, int G, int R>
void tile(const Problem& p, int64_t n0, int64_t r0) {
  const int64_t K = p.K, main = K - K % kLanes;
  const uint16_t* w[G];
  const float* x[R];
  for (int i = 0; i < G; ++i) w[i] = p.w + (n0 + i) * K;
  for (int r = 0; r < R; ++r) x[r] = p.x + (r0 + r) * K;
  Vec acc[G][R];
  for (int i = 0; i < G; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = zero();
  for (int64_t k = 0; k < main; k += kLanes) {
    Vec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = load(x[r] + k);
    for (int i = 0; i < G; ++i) {
      const Vec wv = widen<BF16>(w[i] + k);
      for (int r = 0; r < R; ++r) acc[i][r] = fma(wv, xv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int r = 0; r < R; ++r) {
      float sum = sum_lanes(acc[i][r]);
      for (int64_t k = main; k < K; ++k) sum += widen_one<BF16>(w[i][k]) * x[r][k];
      p.out[(r0 + r) * p.N + n0 + i] = sum;
    }
}

template <bool BF16, int G>
void rows_pass(const Problem& p, int64_t n0, int64_t r0, int64_t rows) {
  switch (rows) {
    case 1: return tile<BF16, G, 1>(p, n0, r0);
#if BLOCKSERVE_HALF_LANES == 16
    case 2: return tile<BF16, G, 2>(p, n0, r0);
    case 3: return tile<BF16, G, 3>(p, n0, r0);
#endif
    default: return tile<BF16, G, kRows>(p, n0, r0);
  }
}

template <bool BF16>
void group(const Problem& p, int64_t g) {
  const int64_t n0 = g * kGroup, outputs = std::min<int64_t>(kGroup, p.N - n0);
  for (int64_t r0 = 0; r0 < p.M; r0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.M - r0);
    switch (outputs) {
      case 1: rows_pass<BF16, 1>(p, n0, r0, rows); break;
      case 2: rows_pass<BF16, 2>(p, n0, r0, rows); break;
      case 3: rows_pass<BF16, 3>(p, n0, r0, rows); break;
      default: rows_pass<BF16, kGroup>(p, n0, r0, rows); break;
    }
  }
}

// Groups in tasks of at least kMinWork multiply-adds (tens of microseconds), on the process's
// TaskPool (task_pool.h), as the quantized matmuls split theirs.
constexpr int64_t kMinWork = int64_t{1} << 18;

template <bool BF16>
void run(const Problem& p) {
  const int64_t groups = (p.N + kGroup - 1) / kGroup;
  const int64_t per_task = std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, p.M * p.K * kGroup));
  for_each_range(groups, per_task, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) group<BF16>(p, g);
  });
}
#endif

}  // namespace

at::Tensor half_matmul(at::Tensor x, at::Tensor weight) {
#if !BLOCKSERVE_HALF_LANES
  TORCH_CHECK(false, "half_matmul was compiled without AVX-512 or AVX2 + FMA + F16C (check half_matmul_lanes() first)");
#else
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "half_matmul: x must be 2-D float32");
  TORCH_CHECK((weight.dtype() == at::kBFloat16 || weight.dtype() == at::kHalf) && weight.dim() == 2,
              "half_matmul: weight must be 2-D bfloat16 or float16");
  TORCH_CHECK(weight.is_contiguous(), "half_matmul: weight must be contiguous (row-major [out, in])");
  TORCH_CHECK(x.size(1) == weight.size(1), "half_matmul: x has ", x.size(1), " columns, weight ", weight.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Problem p{x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(weight.data_ptr()), out.data_ptr<float>(),
                  M, K, N};
  if (weight.dtype() == at::kBFloat16) run<true>(p); else run<false>(p);
  return out;
#endif
}

int64_t half_matmul_lanes() { return BLOCKSERVE_HALF_LANES; }

}  // namespace blockserve
