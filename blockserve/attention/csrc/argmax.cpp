// Greedy sampling's argmax over a row of logits, without an OpenMP region: torch's max(dim) at
// one row tracks indices in scalar code (~30 us over a 49k vocabulary) and, at two threads with
// OMP_WAIT_POLICY=PASSIVE, can pay a sleeping thread's wake-up besides (~110 us in a decode step).
// Two vector passes instead: the row's max (NaN noted), then the first index holding it. The
// answer is torch's: the first maximum; the first NaN where the row has one.

#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace blockserve {

namespace {

// The row's max, or NaN when it holds one.
float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  best = _mm512_reduce_max_ps(m);
  nan = unordered != 0;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 m = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float lane : lanes) best = lane > best ? lane : best;
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

// The first index of `value` in the row (of the first NaN when value is NaN).
int64_t first_index(const float* x, int64_t n, float value) {
  if (std::isnan(value)) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(value);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 target = _mm256_set1_ps(value);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == value) return i;
  return 0;  // unreachable: value is an element of the row
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: [N, V] with V > 0 expected");
  TORCH_CHECK(x.dtype() == at::kFloat && x.stride(1) == 1, "argmax_rows: float32 rows, contiguous");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // ~4 us a row of 49k: rows split over threads only in batches of many (a wake-up costs ~100 us).
  const int64_t rows_per_task = std::max<int64_t>(1, (int64_t{1} << 20) / n);
  at::parallel_for(0, rows, rows_per_task, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      op[r] = first_index(row, n, row_max(row, n));
    }
  });
  return out;
}

}  // namespace blockserve
