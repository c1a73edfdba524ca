// out = x @ W^T with W kept in a GGUF block format (Q4_1 or Q8_0; Q4_0 is packed as Q4_1) and
// dequantised in registers: the weights are exactly the values the format encodes (what gguf's
// dequantiser produces), read at 0.75 (Q4_1) or 1.125 (Q8_0) bytes per weight instead of 4.
// For the rows of a decode batch, where a float32 matmul is bound by reading its weights. Three
// kernels over the same packed blocks: quantized_matmul (float32 activations, exact up to float
// rounding), quantized_matmul_int8 and quantized_matmul_int16 (activations rounded to 8 or 16
// bits per block, integer dot products; see their section below). An AVX-512 path and an AVX2 one
// (8 lanes), chosen at compile time (-march=native); simd_lanes() says which.
//
// Per block of 32 weights:  Q4_1  w = d * q + m   (q in 0..15)     Q8_0  w = d * q   (q in -128..127)
// so a row's dot product is  sum_b d_b * (q_b . x_b) + m_b * sum(x_b); the block sums of x are
// computed once per call.
//
// Packed layout (pack_blocks in models/quantized_linear.py): output rows in groups of
// four, each group one contiguous run of blocks so a group streams from memory in order:
//   Q4_1 group block (96 B):  d[4] f32 | m[4] f32 | 4 x 16 B nibbles (byte j: weight j low, j+16 high)
//   Q8_0 group block (144 B): d[4] f32 | 4 x 32 int8
// The row count is padded to a multiple of four with zero rows.

#include "kernels.h"

#include "block_levels.h"
#include "lane_reduce.h"
#include "task_pool.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BLOCKSERVE_AVX512 1
#define BLOCKSERVE_LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define BLOCKSERVE_AVX2 1
#define BLOCKSERVE_LANES 8
#else
#define BLOCKSERVE_LANES 0
#endif
#if BLOCKSERVE_LANES
#include <immintrin.h>
#endif

namespace blockserve {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 4;   // output rows packed together
constexpr int64_t kRows = 8;  // the most rows of x sharing one pass over a group (registers)
constexpr int64_t kPrefetchBlocks = 24;  // how far ahead (in group blocks) to prefetch weights

template <bool Q4> constexpr int64_t group_block_bytes() { return Q4 ? 96 : 144; }

struct Problem {
  const float* x;      // [M, K]
  const float* mixed;  // [M, K] x in mixed_halves' form (Q4_1 on AVX2, for passes of 1-2 rows)
  const float* xsum;   // [M, K / 32] block sums of x (Q4_1 only)
  const uint8_t* w;    // packed groups
  float* out;          // [M, N]
  int64_t M, K, N;
};

#if BLOCKSERVE_LANES
// Every line of the group block kPrefetchBlocks ahead: a few KB of weights in flight.
template <bool Q4>
inline void prefetch_ahead(const uint8_t* gb) {
  for (int64_t line = 0; line < group_block_bytes<Q4>(); line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(gb) + kPrefetchBlocks * group_block_bytes<Q4>() + line, _MM_HINT_T0);
}
#endif

#ifdef BLOCKSERVE_AVX512
// Quarter q (lanes 4q..4q+4) of v.
inline __m128 quarter(__m512 v, int q) {
  switch (q) {
    case 0: return _mm512_castps512_ps128(v);
    case 1: return _mm512_extractf32x4_ps(v, 1);
    case 2: return _mm512_extractf32x4_ps(v, 2);
    default: return _mm512_extractf32x4_ps(v, 3);
  }
}

// Rows r0 + first_row.. r0 + first_row + rows of out, columns g*4..g*4+4 (those below N): row
// first_row + q's four sums in quarter q of `sums`, plus its min terms (0 for Q8_0), as one masked
// store a row (the sums stay in registers: no store of them and reload lane by lane).
inline void store_sums(const Problem& p, int64_t g, int64_t r0, int first_row, int rows, __m512 sums,
                       const __m128* min_acc) {
  const __mmask8 live = static_cast<__mmask8>((1u << std::min<int64_t>(kGroup, p.N - g * kGroup)) - 1);
  for (int q = 0; q < rows; ++q) {
    const int r = first_row + q;
    _mm_mask_storeu_ps(p.out + (r0 + r) * p.N + g * kGroup, live, _mm_add_ps(quarter(sums, q), min_acc[r]));
  }
}

// Rows r0..r0+R of x against output rows g*4..g*4+4 (those below N), 16 lanes at a time: each
// weight is widened to float once and used for the R rows of x.
template <bool Q4, int R>
void group_avx512(const Problem& p, int64_t g, int64_t r0) {
  const int64_t blocks = p.K / kBlock;
  const uint8_t* gb = p.w + g * blocks * group_block_bytes<Q4>();
  __m512 acc[kGroup][R];
  __m128 min_acc[R];
  for (int r = 0; r < R; ++r) {
    min_acc[r] = _mm_setzero_ps();
    for (int i = 0; i < kGroup; ++i) acc[i][r] = _mm512_setzero_ps();
  }
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t b = 0; b < blocks; ++b, gb += group_block_bytes<Q4>()) {
    prefetch_ahead<Q4>(gb);
    __m512 x_lo[R], x_hi[R];
    for (int r = 0; r < R; ++r) {
      const float* x = p.x + (r0 + r) * p.K + b * kBlock;
      x_lo[r] = _mm512_loadu_ps(x);
      x_hi[r] = _mm512_loadu_ps(x + 16);
    }
    const float* d = reinterpret_cast<const float*>(gb);
    for (int i = 0; i < kGroup; ++i) {
      const __m512 scale = _mm512_set1_ps(d[i]);  // d * q is exact in float32: the weight less m
      __m512 w_lo, w_hi;
      if constexpr (Q4) {  // d * q looked up in a 16-entry table (the lookup reads each lane's low 4 bits)
        const __m512 table = _mm512_mul_ps(levels, scale);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 32 + 16 * i)));
        w_lo = _mm512_permutexvar_ps(q, table);
        w_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
      } else {
        const __m128i* q = reinterpret_cast<const __m128i*>(gb + 16 + 32 * i);
        w_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), scale);
        w_hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), scale);
      }
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(w_hi, x_hi[r], _mm512_fmadd_ps(w_lo, x_lo[r], acc[i][r]));
    }
    if constexpr (Q4) {
      const __m128 m = _mm_loadu_ps(reinterpret_cast<const float*>(gb + 16));
      for (int r = 0; r < R; ++r)
        min_acc[r] = _mm_fmadd_ps(m, _mm_set1_ps(p.xsum[(r0 + r) * blocks + b]), min_acc[r]);
    }
  }
  __m512 by_row[R * kGroup];  // acc[i][r] at 4 r + i: row r's four sums in quarter r of the lane sums
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kGroup; ++i) by_row[r * kGroup + i] = acc[i][r];
  store_sums(p, g, r0, 0, R, lanes_reduce_add<R * kGroup>(by_row), min_acc);
}

// 5-8 rows of x (a speculative verification's k + 1 rows): 4 outputs x R rows of accumulators
// leave no registers for the weights, so two passes over the group's blocks (from L1 the second
// time), each for two of its output rows (2 x R accumulators, x loaded per row and used for both).
// Per output row and row of x the arithmetic of group_avx512 in the same order, so a row gets the
// same bits in a pass of any size: Q4_1's min terms are summed lane by lane as group_avx512 sums
// them, in the first pass (R independent chains beside the multiply-adds, not R chains of one
// multiply-add per block in a loop of their own), and each pass's 2 R sums of lanes are taken
// together (lanes_reduce_add: _mm512_reduce_add_ps's additions, a third of its instructions).
template <bool Q4, int R, bool First>
inline void halves_pass(const Problem& p, const uint8_t* group, int64_t first, int64_t r0, __m512 (&acc)[2][R],
                        __m128 (&min_acc)[R]) {
  const int64_t blocks = p.K / kBlock;
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t* gb = group;
  for (int64_t b = 0; b < blocks; ++b, gb += group_block_bytes<Q4>()) {
    if constexpr (First) prefetch_ahead<Q4>(gb);
    const float* d = reinterpret_cast<const float*>(gb);
    __m512 w_lo[2], w_hi[2];
    for (int i = 0; i < 2; ++i) {
      const __m512 scale = _mm512_set1_ps(d[first + i]);
      if constexpr (Q4) {
        const __m512 table = _mm512_mul_ps(levels, scale);
        const __m512i q = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 32 + 16 * (first + i))));
        w_lo[i] = _mm512_permutexvar_ps(q, table);
        w_hi[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
      } else {
        const __m128i* q = reinterpret_cast<const __m128i*>(gb + 16 + 32 * (first + i));
        w_lo[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), scale);
        w_hi[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), scale);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* x = p.x + (r0 + r) * p.K + b * kBlock;
      __m512 x_lo = _mm512_loadu_ps(x), x_hi = _mm512_loadu_ps(x + 16);
      // In registers: each of x's vectors loaded once for both output rows (compilers otherwise fold
      // a load into each multiply-add, twice the loads, as many as multiply-adds).
      asm("" : "+v"(x_lo), "+v"(x_hi));
      for (int i = 0; i < 2; ++i)
        acc[i][r] = _mm512_fmadd_ps(w_hi[i], x_hi, _mm512_fmadd_ps(w_lo[i], x_lo, acc[i][r]));
    }
    if constexpr (Q4 && First) {
      const __m128 m = _mm_loadu_ps(reinterpret_cast<const float*>(gb + 16));
      for (int r = 0; r < R; ++r)
        min_acc[r] = _mm_fmadd_ps(m, _mm_set1_ps(p.xsum[(r0 + r) * blocks + b]), min_acc[r]);
    }
  }
}

template <bool Q4, int R>
void group_avx512_halves(const Problem& p, int64_t g, int64_t r0) {
  const int64_t blocks = p.K / kBlock;
  const uint8_t* group = p.w + g * blocks * group_block_bytes<Q4>();
  constexpr int kHalf = kGroup / 2;
  __m128 min_acc[R];
  for (int r = 0; r < R; ++r) min_acc[r] = _mm_setzero_ps();
  __m512 half_sums[2];  // per pass: acc[i][r]'s lane sum in lane 2 r + i
  for (int64_t first = 0; first < kGroup; first += kHalf) {
    if (g * kGroup + first >= p.N) {  // the group's last two output rows are padding
      half_sums[1] = _mm512_setzero_ps();
      break;
    }
    __m512 acc[kHalf][R];
    for (int i = 0; i < kHalf; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    if (first == 0) halves_pass<Q4, R, true>(p, group, first, r0, acc, min_acc);
    else halves_pass<Q4, R, false>(p, group, first, r0, acc, min_acc);
    __m512 by_row[R * kHalf];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kHalf; ++i) by_row[r * kHalf + i] = acc[i][r];
    half_sums[first / kHalf] = lanes_reduce_add<R * kHalf>(by_row);
  }
  // Row r's four sums into quarter r (rows 0-3) or r - 4 (rows 4-7): lanes 2 r, 2 r + 1 of each pass.
  const __m512i low_rows = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
  store_sums(p, g, r0, 0, 4, _mm512_permutex2var_ps(half_sums[0], low_rows, half_sums[1]), min_acc);
  const __m512i high_rows = _mm512_add_epi32(low_rows, _mm512_set1_epi32(8));
  store_sums(p, g, r0, 4, R - 4, _mm512_permutex2var_ps(half_sums[0], high_rows, half_sums[1]), min_acc);
}

template <bool Q4>
void group_simd(const Problem& p, int64_t g, int64_t r0, int64_t R) {
  switch (R) {
    case 1: return group_avx512<Q4, 1>(p, g, r0);
    case 2: return group_avx512<Q4, 2>(p, g, r0);
    case 3: return group_avx512<Q4, 3>(p, g, r0);
    case 4: return group_avx512<Q4, 4>(p, g, r0);
    case 5: return group_avx512_halves<Q4, 5>(p, g, r0);
    case 6: return group_avx512_halves<Q4, 6>(p, g, r0);
    case 7: return group_avx512_halves<Q4, 7>(p, g, r0);
    default: return group_avx512_halves<Q4, 8>(p, g, r0);
  }
}
#endif

#ifdef BLOCKSERVE_AVX2
// The same with 8 lanes (CPUs without AVX-512). From 3 rows of x (group_avx2), one output row of
// the group at a time: a block of its levels is converted once (no 16-entry lookup in AVX2) into
// four vectors and used for the block of each of R rows of x. Holding one output row's
// accumulators (not four) leaves registers for R = 8 rows of x, so the conversion is shared by up
// to 8 rows. The four passes find the group's blocks in L1; the next group is prefetched a line
// per block meanwhile, so memory streams while the passes compute. Two ways to apply the block's
// scale d, by R:
// - R < kPrescaleRows: q . x over the block, then one multiply-add by d per row (few rows: the
//   conversion dominates, and each row's running sum takes one dependent step per block);
// - R >= kPrescaleRows: d * q once per weight (exact in float32), then four multiply-adds per row
//   straight into its sum: 4 R + 4 instead of 5 R multiplies, where the multiplies dominate.
// 1-2 rows of x take the group's four output rows in one pass (group_avx2_all_outputs), Q4_1 with
// fewer instructions per weight (mixed_halves). Q4_1's min terms take one 4-lane multiply-add per
// block and row of x, for the four output rows.
constexpr int kPrescaleRows = 6;

// A Q4_1 block's 16 bytes hold b_j = lo_j + 16 hi_j (lo_j the level of weight j, hi_j of weight
// 16 + j), so
//   q . x = sum_j lo_j x[j] + hi_j x[16 + j] = sum_j lo_j (x[j] - x[16 + j] / 16) + b_j (x[16 + j] / 16)
// The bytes are used whole and only the low nibbles masked off: 8 instead of 10 instructions per
// block and output row widen the levels, the cost that bounds passes of one or two rows
// (group_avx2_all_outputs: 1.01-1.10x per layer at one row; passes of more rows load more than
// they widen and were no faster, so they keep the plain form). x comes in the matching form (mixed_halves:
// each block's two halves replaced by the two brackets). Exact in real arithmetic; in float32 one
// more rounding per element of x (x / 16 is exact).
void mixed_halves(const float* x, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, x += kBlock, out += kBlock)
    for (int64_t j = 0; j < 16; ++j) {
      out[16 + j] = x[16 + j] * 0.0625f;
      out[j] = x[j] - out[16 + j];
    }
}

// Output row i's block gb as four vectors of floats, w[k] to multiply the block's x[8k, 8k + 8):
// Q8_0 (and Q4_1 unmixed) the levels of weights 8k to 8k + 8; Q4_1 Mixed the low nibbles of bytes
// 0-7, 8-15, then the bytes, to multiply x in mixed_halves' form.
template <bool Q4, bool Mixed = false>
inline void levels_avx2(const uint8_t* gb, int64_t i, __m256 w[4]) {
  if constexpr (Q4) {
    const uint8_t* q = gb + 32 + 16 * i;
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low4));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(c, low4));
    w[2] = _mm256_cvtepi32_ps(Mixed ? a : _mm256_srli_epi32(a, 4));
    w[3] = _mm256_cvtepi32_ps(Mixed ? c : _mm256_srli_epi32(c, 4));
  } else {
    const uint8_t* q = gb + 16 + 32 * i;
    for (int k = 0; k < 4; ++k)
      w[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k))));
  }
}

// One or two rows of x (decode steps of one or two sequences): the group's four output rows in one
// pass, so their running sums are 4 R independent chains (a pass per output row waits a
// multiply-add's latency per block on its R chains). Q8_0: per output row and row of x the
// arithmetic of group_avx2 below, the same bits; Q4_1: x in mixed_halves' form (other bits).
template <bool Q4, int R>
void group_avx2_all_outputs(const Problem& p, int64_t g, int64_t r0) {
  const int64_t blocks = p.K / kBlock;
  const int64_t group_bytes = blocks * group_block_bytes<Q4>();
  const uint8_t* gb = p.w + g * group_bytes;
  const char* next = reinterpret_cast<const char*>(gb + group_bytes);
  __m256 acc[kGroup][R];
  __m128 min_acc[R];
  for (int r = 0; r < R; ++r) {
    min_acc[r] = _mm_setzero_ps();
    for (int i = 0; i < kGroup; ++i) acc[i][r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b, gb += group_block_bytes<Q4>()) {
    for (int64_t line = 128 * b; r0 == 0 && line < 128 * (b + 1) && line < group_bytes; line += 64)
      _mm_prefetch(next + line, _MM_HINT_T0);
    const float* x = (Q4 ? p.mixed : p.x) + r0 * p.K + b * kBlock;
    for (int i = 0; i < kGroup; ++i) {  // the packing pads the group to four rows: all four are readable
      __m256 w[4];
      levels_avx2<Q4, true>(gb, i, w);
      const __m256 scale = _mm256_set1_ps(reinterpret_cast<const float*>(gb)[i]);
      for (int r = 0; r < R; ++r) {
        __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(x + r * p.K));
        for (int k = 1; k < 4; ++k) dot = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x + r * p.K + 8 * k), dot);
        acc[i][r] = _mm256_fmadd_ps(dot, scale, acc[i][r]);
      }
    }
    if constexpr (Q4) {
      const __m128 m = _mm_loadu_ps(reinterpret_cast<const float*>(gb + 16));
      for (int r = 0; r < R; ++r) min_acc[r] = _mm_fmadd_ps(m, _mm_set1_ps(p.xsum[(r0 + r) * blocks + b]), min_acc[r]);
    }
  }
  __m256 by_row[R * kGroup];  // acc[i][r] at 4 r + i: row r's four sums in half r of the lane sums
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kGroup; ++i) by_row[r * kGroup + i] = acc[i][r];
  const __m256 sums = lanes_add8_each<R * kGroup>(by_row);
  const int64_t live = std::min<int64_t>(kGroup, p.N - g * kGroup);
  for (int r = 0; r < R; ++r) {  // min_acc is 0 for Q8_0
    const __m128 row = _mm_add_ps(r == 0 ? _mm256_castps256_ps128(sums) : _mm256_extractf128_ps(sums, 1), min_acc[r]);
    float* out = p.out + (r0 + r) * p.N + g * kGroup;
    if (live == kGroup) {
      _mm_storeu_ps(out, row);
    } else {  // the padded last group (a masked store, vmaskmovps, is slow on AMD)
      alignas(16) float sums_row[kGroup];
      _mm_store_ps(sums_row, row);
      std::copy_n(sums_row, live, out);
    }
  }
}

template <bool Q4, int R>
void group_avx2(const Problem& p, int64_t g, int64_t r0) {
  const int64_t blocks = p.K / kBlock;
  const int64_t group_bytes = blocks * group_block_bytes<Q4>();
  const uint8_t* group = p.w + g * group_bytes;
  const char* next = reinterpret_cast<const char*>(group + group_bytes);
  alignas(16) float mins[R][kGroup] = {};
  if constexpr (Q4) {  // the R rows' sums side by side: R chains of one multiply-add per block at once
    const float* xsum = p.xsum + r0 * blocks;
    __m128 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m128 m = _mm_loadu_ps(reinterpret_cast<const float*>(group + b * group_block_bytes<Q4>() + 16));
      for (int r = 0; r < R; ++r) sum[r] = _mm_fmadd_ps(m, _mm_set1_ps(xsum[r * blocks + b]), sum[r]);
    }
    for (int r = 0; r < R; ++r) _mm_store_ps(mins[r], sum[r]);
  }
  for (int64_t i = 0; i < kGroup && g * kGroup + i < p.N; ++i) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* gb = group;
    for (int64_t b = 0; b < blocks; ++b, gb += group_block_bytes<Q4>()) {
      if (const int64_t line = 64 * (i * blocks + b); r0 == 0 && line < group_bytes) _mm_prefetch(next + line, _MM_HINT_T0);
      __m256 w[4];
      levels_avx2<Q4>(gb, i, w);
      const __m256 scale = _mm256_set1_ps(reinterpret_cast<const float*>(gb)[i]);
      const float* x = p.x + r0 * p.K + b * kBlock;
      if constexpr (R >= kPrescaleRows) {
        for (int k = 0; k < 4; ++k) w[k] = _mm256_mul_ps(w[k], scale);
        for (int k = 0; k < 4; ++k)
          for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x + r * p.K + 8 * k), acc[r]);
      } else {
        for (int r = 0; r < R; ++r) {
          __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(x + r * p.K));
          for (int k = 1; k < 4; ++k) dot = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x + r * p.K + 8 * k), dot);
          acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
        }
      }
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, lanes_add8_each<R>(acc));
    for (int r = 0; r < R; ++r) p.out[(r0 + r) * p.N + g * kGroup + i] = sums[r] + mins[r][i];
  }
}

template <bool Q4>
void group_simd(const Problem& p, int64_t g, int64_t r0, int64_t R) {
  switch (R) {
    case 1: return group_avx2_all_outputs<Q4, 1>(p, g, r0);
    case 2: return group_avx2_all_outputs<Q4, 2>(p, g, r0);
    case 3: return group_avx2<Q4, 3>(p, g, r0);
    case 4: return group_avx2<Q4, 4>(p, g, r0);
    case 5: return group_avx2<Q4, 5>(p, g, r0);
    case 6: return group_avx2<Q4, 6>(p, g, r0);
    case 7: return group_avx2<Q4, 7>(p, g, r0);
    default: return group_avx2<Q4, 8>(p, g, r0);
  }
}
#endif

#if BLOCKSERVE_LANES

// The row groups in tasks of >= `min_work` group-block-rows (one group's block against one row of
// x; ~30 us of work), run on the process's TaskPool (task_pool.h): a decode step's ~120 calls hand
// over to spinning workers in microseconds, and the pool sleeps between steps.
template <typename F>
void for_each_group_range(int64_t groups, int64_t M, int64_t K, int64_t min_work, const F& body) {
  blockserve::for_each_range(groups, std::max<int64_t>(1, min_work / (M * (K / kBlock))), body);
}

template <bool Q4>
void run(const Problem& p) {
  const int64_t groups = (p.N + kGroup - 1) / kGroup;
  for_each_group_range(groups, p.M, p.K, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r0 = 0; r0 < p.M; r0 += kRows)  // the group's weights stay in L1 across passes
        group_simd<Q4>(p, g, r0, std::min(kRows, p.M - r0));
  });
}
#endif

// ---- integer activations (int8, int16) ----------------------------------------------------
// quantized_matmul_int8 and quantized_matmul_int16 round each row of x per block of 32 to L levels
// either side of zero (int8: L = 127, as llama.cpp's q8 formats do; int16: L = 32767):
//   s = max|x_b| / L,  x_b ~ s * r  (r = round-to-nearest-even(x_b * (L / max|x_b|)))
// and take integer dot products of r with the weights' integer levels, one float multiply by
// d * s per block and output row; Q4_1's min term takes the sum of the rounded block (llama.cpp's q8_1):
//   out = sum_b d_b * s_b * (q_b . r_b) + m_b * s_b * sum(r_b)  =  (x rounded) @ W^T
// so only the rounding of x differs from quantized_matmul: |error| <= sum_k |w_k| * s_k / 2.
// The weights' bytes are read once per group of four output rows for kIntRows rows of x at a
// time, straight from the packed layout above; both SIMD builds run the same 256-bit loop. int8:
// one block of levels is one register, multiplied by bytes (maddubs + madd; AVX-512 builds: VNNI's
// dpbusd). int16: two registers, the weights widened to 16 bits (madd, pairs of products into
// int32; AVX-512 builds: dpwssd), 256 times finer rounding for about twice the multiplies.

#if BLOCKSERVE_LANES
// Rows of x per pass over a group's weights: as many accumulators as the vector registers leave
// room for beside the weights (AVX-512 builds: 32 registers, so a verification's 5-8 rows share one pass).
constexpr int64_t kIntRows = BLOCKSERVE_LANES == 16 ? 8 : 4;

template <typename Level>
struct IntProblem {
  const Level* r;      // [M, K] x rounded per block
  const float* s;      // [M, K / 32] the blocks' scales
  const float* xsum;   // [M, K / 32] s * the sum of the block's levels (Q4_1 only)
  const uint8_t* w;    // packed groups
  float* out;          // [M, N]
  int64_t M, K, N;
};

// Eight int32 lanes summing to u . v (u unsigned, v signed bytes; no adjacent pair of products
// may leave int16, which holds for 4-bit weights and for |int8 weights| . int8 levels in -127..127).
inline __m256i dot_u8s8(__m256i u, __m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

// Eight int32 lanes summing to w . x over 32 int16 pairs (w[0], x[0]: 0-15; w[1], x[1]: 16-31).
// Exact: |4-bit or int8 weight| <= 128 and |level| <= 32767 keep every pair and sum within int32.
inline __m256i dot_s16(const __m256i w[2], __m256i x0, __m256i x1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w[0], x0), w[1], x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w[0], x0), _mm256_madd_epi16(w[1], x1));
#endif
}

// The four output rows' dot products: [p0 p1 p2 p3 | p0' p1' p2' p3'], the two halves summing to them.
inline __m256 group_dots(const __m256i p[kGroup]) {
  return _mm256_cvtepi32_ps(_mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3])));
}

// The four output rows' integer dots with one row's block of levels `x`. Weights: int8, one
// register per output row (Q4: the levels 0..15; Q8_0: |q|, its signs moved onto x); int16,
// two per output row, weights 0-15 and 16-31 widened to 16 bits.
template <bool Q4, typename Level, typename Weights>
inline void block_dots(const Weights& w, const Level* x, __m256i dots[kGroup]) {
  if constexpr (sizeof(Level) == 1) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    for (int i = 0; i < kGroup; ++i)
      dots[i] = Q4 ? dot_u8s8(w[i], v) : dot_u8s8(_mm256_sign_epi8(w[i], w[i]), _mm256_sign_epi8(v, w[i]));
  } else {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
    for (int i = 0; i < kGroup; ++i) dots[i] = dot_s16(w[i], x0, x1);
  }
}

// Rows r0..r0+R of x against output rows g*4..g*4+4 (those below N): each block's weights are
// widened once and dotted with the R rows' levels; the accumulators hold the four outputs
// twice over (the two halves of group_dots), added at the end.
template <bool Q4, int R, typename Level>
void group_int(const IntProblem<Level>& p, int64_t g, int64_t r0) {
  constexpr bool kWide = sizeof(Level) == 2;
  const int64_t blocks = p.K / kBlock;
  const uint8_t* gb = p.w + g * blocks * group_block_bytes<Q4>();
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, gb += group_block_bytes<Q4>()) {
    prefetch_ahead<Q4>(gb);
    const __m256 d = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(gb));
    std::conditional_t<kWide, __m256i[kGroup][2], __m256i[kGroup]> w;
    for (int i = 0; i < kGroup; ++i) {
      if constexpr (Q4) {  // byte j holds weight j (low nibble) and j + 16 (high)
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 32 + 16 * i));
        if constexpr (kWide) {
          const __m256i words = _mm256_cvtepu8_epi16(q);
          w[i][0] = _mm256_and_si256(words, _mm256_set1_epi16(15));
          w[i][1] = _mm256_srli_epi16(words, 4);
        } else {
          w[i] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
        }
      } else {
        const uint8_t* q = gb + 16 + 32 * i;
        if constexpr (kWide) {
          for (int h = 0; h < 2; ++h)
            w[i][h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
        } else {
          w[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        }
      }
    }
    const __m256 m = Q4 ? _mm256_zextps128_ps256(_mm_loadu_ps(reinterpret_cast<const float*>(gb + 16)))
                        : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t row_block = (r0 + r) * blocks + b;
      __m256i dots[kGroup];
      block_dots<Q4>(w, p.r + row_block * kBlock, dots);
      acc[r] = _mm256_fmadd_ps(group_dots(dots), _mm256_mul_ps(d, _mm256_set1_ps(p.s[row_block])), acc[r]);
      if constexpr (Q4) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(p.xsum[row_block]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float sums[kGroup];
    _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1)));
    for (int64_t i = 0; i < kGroup && g * kGroup + i < p.N; ++i) p.out[(r0 + r) * p.N + g * kGroup + i] = sums[i];
  }
}

// Rows of x per pass over all the weights: a tile's levels (at most 128 x K levels) stay in L2 while
// the weights stream past them, so a prefill of any length runs here. Each output is the same
// arithmetic in the same order whatever the tile or the row count: a row's result does not depend
// on what shares its call.
constexpr int64_t kIntTileRows = 128;

template <bool Q4, typename Level>
void run_int(const IntProblem<Level>& p) {
  const int64_t groups = (p.N + kGroup - 1) / kGroup;
  for (int64_t tile = 0; tile < p.M; tile += kIntTileRows) {
    const int64_t tile_end = std::min(p.M, tile + kIntTileRows);
    for_each_group_range(groups, tile_end - tile, p.K, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        for (int64_t r0 = tile; r0 < tile_end; r0 += kIntRows) {  // the group's weights stay in L1 across passes
          switch (std::min(kIntRows, tile_end - r0)) {
            case 1: group_int<Q4, 1>(p, g, r0); break;
            case 2: group_int<Q4, 2>(p, g, r0); break;
            case 3: group_int<Q4, 3>(p, g, r0); break;
#if BLOCKSERVE_LANES == 16
            case 4: group_int<Q4, 4>(p, g, r0); break;
            case 5: group_int<Q4, 5>(p, g, r0); break;
            case 6: group_int<Q4, 6>(p, g, r0); break;
            case 7: group_int<Q4, 7>(p, g, r0); break;
            default: group_int<Q4, 8>(p, g, r0); break;
#else
            default: group_int<Q4, 4>(p, g, r0); break;
#endif
          }
        }
    });
  }
}
#endif

// Checks shared by both entry points; returns x contiguous.
at::Tensor checked_input(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool q4_1) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "x: 2-D float32 expected");
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous(), "packed: contiguous uint8 expected");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "in_features must be a multiple of 32 for GGUF block formats");
  const int64_t groups = (N + kGroup - 1) / kGroup;
  const int64_t bytes = groups * (K / kBlock) * (q4_1 ? group_block_bytes<true>() : group_block_bytes<false>());
  TORCH_CHECK(packed.numel() == bytes, "packed weights have ", packed.numel(), " bytes; ", bytes,
              " expected for ", N, " x ", K);
  return x.contiguous();
}

// The integer-activation kernels: x rounded to Level per block, then integer dots (see their section).
template <typename Level>
at::Tensor quantized_matmul_levels(at::Tensor x, const at::Tensor& packed, int64_t out_features, bool q4_1) {
#if !BLOCKSERVE_LANES
  TORCH_CHECK(false, "quantized_matmul_int", 8 * sizeof(Level),
              " was compiled without AVX-512 or AVX2 (check simd_lanes() first)");
#else
  x = checked_input(x, packed, out_features, q4_1);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  std::vector<Level> levels(M * K);
  std::vector<float> scales(M * K / kBlock), sums(M * K / kBlock);
  quantize_blocks(x.data_ptr<float>(), M * K / kBlock, levels.data(), scales.data(), sums.data());
  const IntProblem<Level> p{levels.data(), scales.data(), sums.data(), packed.data_ptr<uint8_t>(),
                            out.data_ptr<float>(), M, K, N};
  if (q4_1) run_int<true>(p); else run_int<false>(p);
  return out;
#endif
}

}  // namespace

at::Tensor quantized_matmul_int8(at::Tensor x, at::Tensor packed, int64_t out_features, bool q4_1) {
  return quantized_matmul_levels<int8_t>(x, packed, out_features, q4_1);
}

at::Tensor quantized_matmul_int16(at::Tensor x, at::Tensor packed, int64_t out_features, bool q4_1) {
  return quantized_matmul_levels<int16_t>(x, packed, out_features, q4_1);
}

at::Tensor quantized_matmul(at::Tensor x, at::Tensor packed, int64_t out_features, bool q4_1) {
#if !BLOCKSERVE_LANES
  TORCH_CHECK(false, "quantized_matmul was compiled without AVX-512 or AVX2 (check simd_lanes() first)");
#else
  x = checked_input(x, packed, out_features, q4_1);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(q4_1 ? M * K / kBlock : 0);
  for (size_t b = 0; b < xsum.size(); ++b) {
    float sum = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) sum += xp[b * kBlock + j];
    xsum[b] = sum;
  }
  at::Tensor mixed;  // a tensor, not a vector: 64-byte aligned, so no load of 8 floats splits a cache line
#ifdef BLOCKSERVE_AVX2
  if (q4_1 && (M % kRows == 1 || M % kRows == 2)) {  // a pass of one or two rows is to come
    mixed = at::empty_like(x);
    mixed_halves(xp, M * K / kBlock, mixed.data_ptr<float>());
  }
#endif
  const Problem p{xp, mixed.defined() ? mixed.data_ptr<float>() : nullptr, xsum.data(), packed.data_ptr<uint8_t>(),
                  out.data_ptr<float>(), M, K, N};
  if (q4_1) run<true>(p); else run<false>(p);
  return out;
#endif
}

namespace {

// Output row i of a packed group block as its 32 float32 weights: Q4_1 d * q + m (d * q is exact
// in float32, so one rounding, as gguf-py's), Q8_0 d * q (exact). The prefill tiles' dequantiser:
// a tile's time is spent here besides the GEMM, so the levels are widened a vector at a time
// (AVX-512: the 16 values d * q + m looked up per lane, as the matmul kernel does).
inline void dequantize_q4_1(const uint8_t* gb, int64_t i, float* dst) {
  const float d = reinterpret_cast<const float*>(gb)[i], m = reinterpret_cast<const float*>(gb + 16)[i];
  const uint8_t* q = gb + 32 + 16 * i;  // byte j: weight j (low nibble), weight j + 16 (high)
#ifdef BLOCKSERVE_AVX512
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(d)), _mm512_set1_ps(m));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  _mm512_storeu_ps(dst, _mm512_permutexvar_ps(bytes, table));
  _mm512_storeu_ps(dst + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table));
#elif defined(BLOCKSERVE_AVX2)
  const __m256 scale = _mm256_set1_ps(d), min = _mm256_set1_ps(m);
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int h = 0; h < 2; ++h) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
    const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low4));
    const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    _mm256_storeu_ps(dst + 8 * h, _mm256_add_ps(_mm256_mul_ps(low, scale), min));
    _mm256_storeu_ps(dst + 16 + 8 * h, _mm256_add_ps(_mm256_mul_ps(high, scale), min));
  }
#else
  for (int64_t j = 0; j < 16; ++j) {
    dst[j] = d * static_cast<float>(q[j] & 15) + m;
    dst[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
  }
#endif
}

inline void dequantize_q8_0(const uint8_t* gb, int64_t i, float* dst) {
  const float d = reinterpret_cast<const float*>(gb)[i];
  const int8_t* q = reinterpret_cast<const int8_t*>(gb + 16 + 32 * i);
  for (int64_t j = 0; j < kBlock; ++j) dst[j] = d * static_cast<float>(q[j]);  // vectorised by the compiler
}

}  // namespace

at::Tensor quantized_dequantize(at::Tensor packed, int64_t out_features, int64_t in_features, bool q4_1,
                                int64_t row_start, int64_t rows) {
  const int64_t N = out_features, K = in_features;
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous(), "packed: contiguous uint8 expected");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "in_features must be a positive multiple of 32");
  TORCH_CHECK(row_start >= 0 && row_start % kGroup == 0 && rows >= 0 && row_start + rows <= N,
              "rows [", row_start, ", ", row_start + rows, ") are not a run of ", N, " rows starting on a group of 4");
  const int64_t blocks = K / kBlock, gbb = q4_1 ? group_block_bytes<true>() : group_block_bytes<false>();
  TORCH_CHECK(packed.numel() == (N + kGroup - 1) / kGroup * blocks * gbb, "packed weights have ", packed.numel(),
              " bytes; ", (N + kGroup - 1) / kGroup * blocks * gbb, " expected for ", N, " x ", K);
  auto out = at::empty({rows, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t first = row_start / kGroup, groups = (rows + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* gb = w + (first + g) * blocks * gbb;
      const int64_t live = std::min(kGroup, rows - g * kGroup);
      for (int64_t b = 0; b < blocks; ++b, gb += gbb)
        for (int64_t i = 0; i < live; ++i) {
          float* dst = o + (g * kGroup + i) * K + b * kBlock;
          if (q4_1) dequantize_q4_1(gb, i, dst); else dequantize_q8_0(gb, i, dst);
        }
    }
  });
  return out;
}

int64_t simd_lanes() { return BLOCKSERVE_LANES; }

}  // namespace blockserve
