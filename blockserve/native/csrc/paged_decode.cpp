// Decode attention read in place from the paged KV cache: one query token per sequence, no
// gather copy, no padding. Compiled on first use for the machine it runs on (native/extension.py).
//
// For sequence n and query head hq (KV head h = hq / G, G = Hq / Hkv):
//     out[n, hq] = sum_p softmax_p(scale * q[n, hq] . K[p, h]) V[p, h],   p in [key_start[n], seq_len[n])
// where position p lives at k_cache[block_table[n, p / bs], p % bs, h]. Only slots of positions
// below seq_len are read (never an unwritten slot). The softmax runs online, block by block, so
// K and V are read once each.
//
// Three implementations of one sequence's decode: a portable one the compiler vectorises (float32
// caches), and, where the head size is 64, 128 or 256, two written with intrinsics: AVX-512 scores
// 16 keys at a time, AVX2 (+ FMA + F16C, e.g. Zen 3) 8 at a time. Each sums a chunk's per-key
// partial dot products across lanes by one transpose, runs the softmax on those lanes, and also
// reads float16 and bfloat16 caches (widened to float32 in registers; all arithmetic stays float32).

#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <type_traits>
#include <utility>
#include <vector>

#include "fast_exp.h"
#include "lane_reduce.h"
#include "rotary.h"
#include "task_pool.h"

#if defined(__AVX512F__)
#define BLOCKSERVE_AVX512 1
#else
#define BLOCKSERVE_AVX512 0
#endif
#if !BLOCKSERVE_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BLOCKSERVE_AVX2 1
#else
#define BLOCKSERVE_AVX2 0
#endif

namespace blockserve {

// Where the block holding position `base` keeps its K and V rows, and the next block's (null
// where the sequence ends before it).
template <typename T>
struct BlockRows {
  const T* k;
  const T* v;
  const T* next_k;
  const T* next_v;
};

template <typename T>
static inline BlockRows<T> block_rows(const T* kp, const T* vp, const int64_t* table, int64_t base, int64_t stop,
                                      int64_t block_size, int64_t block_stride) {
  const int64_t offset = table[base / block_size] * block_stride;
  if (base + block_size >= stop) return {kp + offset, vp + offset, nullptr, nullptr};
  const int64_t next = table[base / block_size + 1] * block_stride;
  return {kp + offset, vp + offset, kp + next, vp + next};
}

// Requests the K and V rows of slots [lo, hi) in the next block, row_bytes from each row's start
// (the item's own heads), ahead of their use: each path calls it as it starts on the same slots of
// this block, so a few lines at a time are in flight, one block ahead. Requesting the whole next
// block at once (every head's rows: 24 KB of float32 K and V at SmolLM2's shape) read a 64-sequence
// batch's cache from DRAM at 0.76-0.95x the speed on the AVX2 build, about even on AVX-512.
template <typename T>
static inline void prefetch_next(const BlockRows<T>& rows, int64_t lo, int64_t hi, int64_t slot_stride,
                                 int64_t row_bytes) {
  if (rows.next_k == nullptr) return;
  for (int64_t j = lo; j < hi; ++j) {
    const char* k = reinterpret_cast<const char*>(rows.next_k + j * slot_stride);
    const char* v = reinterpret_cast<const char*>(rows.next_v + j * slot_stride);
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      __builtin_prefetch(k + byte);
      __builtin_prefetch(v + byte);
    }
  }
}

// The keys of chunk [lo, lo + n) of the block at `base` that query head hq attends: all n, or with
// Chain (the heads of several rows of one sequence, each with its own end: head_stop[hq]) those
// before its end, so a row's chunks are exactly those its own call would take (0: none).
template <bool Chain>
static inline int64_t head_keys(int64_t n, int64_t base, int64_t lo, const int64_t* head_stop, int64_t hq) {
  if constexpr (Chain) return std::min(n, head_stop[hq] - base - lo);
  return n;
}

// The decode of one sequence: all its query heads against its positions [start, stop), block by
// block, into the online-softmax state acc (weighted V sums), run_max and run_sum, which the
// caller starts at 0, -FLT_MAX and 0 and normalises afterwards. DIM is the head size when known at
// compile time (loops fully unrolled), else 0.
template <int64_t DIM>
static void attend_sequence(const float* __restrict qn, const float* kp, const float* vp, const int64_t* table,
                            int64_t start, int64_t stop, int64_t n_heads, int64_t group, int64_t runtime_dim,
                            int64_t block_size, int64_t slot_stride, float scale, float* __restrict acc,
                            float* __restrict score, float* __restrict run_max, float* __restrict run_sum) {
  const int64_t dim = DIM > 0 ? DIM : runtime_dim;
  const int64_t block_stride = block_size * slot_stride;
  const int64_t row_bytes = ((n_heads - 1) / group + 1) * dim * static_cast<int64_t>(sizeof(float));  // the item's KV heads
  for (int64_t base = start - start % block_size; base < stop; base += block_size) {
    const BlockRows<float> rows = block_rows(kp, vp, table, base, stop, block_size, block_stride);
    prefetch_next(rows, 0, block_size, slot_stride, row_bytes);
    const int64_t lo = std::max(start, base) - base, hi = std::min(stop, base + block_size) - base;
    const float* __restrict kb = rows.k;
    const float* __restrict vb = rows.v;
    for (int64_t hq = 0; hq < n_heads; ++hq) {  // head-outer: its query row stays in registers
      const float* __restrict qh = qn + hq * dim;
      for (int64_t j = lo; j < hi; ++j) {
        const float* __restrict kr = kb + j * slot_stride + (hq / group) * dim;
        float dot = 0.f;
        for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kr[d];
        score[hq * block_size + j] = dot * scale;
      }
    }
    for (int64_t hq = 0; hq < n_heads; ++hq) {
      float* __restrict sh = score + hq * block_size;
      float block_max = run_max[hq];
      for (int64_t j = lo; j < hi; ++j) block_max = std::max(block_max, sh[j]);
      float sum = 0.f;
      for (int64_t j = lo; j < hi; ++j) {
        sh[j] = fast_exp(sh[j] - block_max);
        sum += sh[j];
      }
      const float correction = fast_exp(run_max[hq] - block_max);
      float* __restrict ah = acc + hq * dim;
      for (int64_t d = 0; d < dim; ++d) ah[d] *= correction;
      run_max[hq] = block_max;
      run_sum[hq] = run_sum[hq] * correction + sum;
    }
    for (int64_t hq = 0; hq < n_heads; ++hq) {  // head-outer: its accumulator stays in registers
      float* __restrict ah = acc + hq * dim;
      for (int64_t j = lo; j < hi; ++j) {
        const float w = score[hq * block_size + j];
        const float* __restrict vr = vb + j * slot_stride + (hq / group) * dim;
        for (int64_t d = 0; d < dim; ++d) ah[d] += w * vr[d];
      }
    }
  }
}

#if BLOCKSERVE_AVX512
// 16 cache values widened to float32 (float16 and bfloat16 caches hold half the bytes).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 load16(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The same contract as attend_sequence, head size 16 * C, keys taken 16 at a time: for each query
// head, the chunk's 16 scores land in one vector, the online softmax runs on it, and its weights
// scale the V rows into the head's accumulator (kept in registers for the chunk). With Chain, head
// hq's positions end at head_stop[hq] (<= stop; several rows of a sequence, decode_all): each K and V
// row is read once for all of them, and each head's arithmetic is what it is alone, the same bits.
template <typename T, int C, bool Chain = false>
static void attend_sequence_avx512(const float* __restrict qn, const T* kp, const T* vp, const int64_t* table,
                                   int64_t start, int64_t stop, int64_t n_heads, const int64_t* kv_offset,
                                   int64_t block_size, int64_t slot_stride, float scale, float* __restrict acc,
                                   float* __restrict weights, float* __restrict correction,
                                   float* __restrict run_max, float* __restrict run_sum, const int64_t* head_stop) {
  constexpr int64_t dim = 16 * C;
  const int64_t block_stride = block_size * slot_stride;
  const int64_t row_bytes = (*std::max_element(kv_offset, kv_offset + n_heads) + dim) * static_cast<int64_t>(sizeof(T));
  for (int64_t base = start - start % block_size; base < stop; base += block_size) {
    const BlockRows<T> rows = block_rows(kp, vp, table, base, stop, block_size, block_stride);
    const T* __restrict kb = rows.k;
    const T* __restrict vb = rows.v;
    const int64_t hi = std::min(stop, base + block_size) - base;
    for (int64_t lo = std::max(start, base) - base; lo < hi; lo += 16) {  // keys [lo, lo + n) of the block
      const int64_t n_chunk = std::min<int64_t>(16, hi - lo);
      prefetch_next(rows, lo, std::min(lo + 16, block_size), slot_stride, row_bytes);
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // scores: every head's 16 in one vector
        const int64_t n = head_keys<Chain>(n_chunk, base, lo, head_stop, hq);
        if (Chain && n <= 0) continue;
        const T* kh = kb + lo * slot_stride + kv_offset[hq];
        __m512 q[C], part[16];
        for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qn + hq * dim + 16 * c);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {  // only written slots are read: keys past n stay zero
          part[j] = _mm512_setzero_ps();
          if (j < n)
            for (int c = 0; c < C; ++c) part[j] = _mm512_fmadd_ps(q[c], load16(kh + j * slot_stride + 16 * c), part[j]);
        }
        _mm512_store_ps(weights + 16 * hq, _mm512_mul_ps(lanes_transpose_sum16(part), _mm512_set1_ps(scale)));
      }
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // online softmax; heads are independent chains
        const int64_t n = head_keys<Chain>(n_chunk, base, lo, head_stop, hq);
        if (Chain && n <= 0) continue;
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
        const __m512 score = _mm512_load_ps(weights + 16 * hq);
        const float chunk_max = std::max(run_max[hq], _mm512_mask_reduce_max_ps(valid, score));
        const __m512 w = _mm512_maskz_mov_ps(valid, fast_exp16(_mm512_sub_ps(score, _mm512_set1_ps(chunk_max))));
        correction[hq] = fast_exp(run_max[hq] - chunk_max);
        run_max[hq] = chunk_max;
        run_sum[hq] = run_sum[hq] * correction[hq] + _mm512_reduce_add_ps(w);
        _mm512_store_ps(weights + 16 * hq, w);
      }
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // weighted V rows; even and odd keys in two chains
        const int64_t n = head_keys<Chain>(n_chunk, base, lo, head_stop, hq);
        if (Chain && n <= 0) continue;
        const T* vh = vb + lo * slot_stride + kv_offset[hq];
        const float* wh = weights + 16 * hq;
        __m512 even[C], odd[C];
        for (int c = 0; c < C; ++c) {
          even[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + hq * dim + 16 * c), _mm512_set1_ps(correction[hq]));
          odd[c] = _mm512_setzero_ps();
        }
        int64_t j = 0;
        for (; j + 1 < n; j += 2) {
          const __m512 we = _mm512_set1_ps(wh[j]), wo = _mm512_set1_ps(wh[j + 1]);
          for (int c = 0; c < C; ++c) {
            even[c] = _mm512_fmadd_ps(we, load16(vh + j * slot_stride + 16 * c), even[c]);
            odd[c] = _mm512_fmadd_ps(wo, load16(vh + (j + 1) * slot_stride + 16 * c), odd[c]);
          }
        }
        if (j < n) {
          const __m512 we = _mm512_set1_ps(wh[j]);
          for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(we, load16(vh + j * slot_stride + 16 * c), even[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + hq * dim + 16 * c, _mm512_add_ps(even[c], odd[c]));
      }
    }
  }
}
#endif

#if BLOCKSERVE_AVX2
// 8 cache values widened to float32.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// attend_sequence_avx512's contract on 8 lanes, head size 8 * C: per query head, a chunk's 8
// scores in one vector, the online softmax on it, then its weights scale the V rows into the
// accumulator, 64 floats (8 registers, 8 independent FMA chains) at a time. Chain: as there.
template <typename T, int C, bool Chain = false>
static void attend_sequence_avx2(const float* __restrict qn, const T* kp, const T* vp, const int64_t* table,
                                 int64_t start, int64_t stop, int64_t n_heads, const int64_t* kv_offset,
                                 int64_t block_size, int64_t slot_stride, float scale, float* __restrict acc,
                                 float* __restrict weights, float* __restrict correction,
                                 float* __restrict run_max, float* __restrict run_sum, const int64_t* head_stop) {
  constexpr int64_t dim = 8 * C;
  constexpr int SLICE = C < 8 ? C : 8;  // accumulator registers per pass over a chunk's V rows
  const int64_t block_stride = block_size * slot_stride;
  const int64_t row_bytes = (*std::max_element(kv_offset, kv_offset + n_heads) + dim) * static_cast<int64_t>(sizeof(T));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t base = start - start % block_size; base < stop; base += block_size) {
    const BlockRows<T> rows = block_rows(kp, vp, table, base, stop, block_size, block_stride);
    const T* __restrict kb = rows.k;
    const T* __restrict vb = rows.v;
    const int64_t hi = std::min(stop, base + block_size) - base;
    for (int64_t lo = std::max(start, base) - base; lo < hi; lo += 8) {  // keys [lo, lo + n) of the block
      const int64_t n_chunk = std::min<int64_t>(8, hi - lo);
      prefetch_next(rows, lo, std::min(lo + 8, block_size), slot_stride, row_bytes);
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // scores: every head's 8 in one vector
        const int64_t n = head_keys<Chain>(n_chunk, base, lo, head_stop, hq);
        if (Chain && n <= 0) continue;
        const T* kh = kb + lo * slot_stride + kv_offset[hq];
        const float* qh = qn + hq * dim;
        __m256 part[8];
        for (int j = 0; j < 8; ++j) part[j] = _mm256_setzero_ps();
        for (int c = 0; c < C; ++c) {
          const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j)  // only written slots are read: keys past n stay zero
            if (j < n) part[j] = _mm256_fmadd_ps(qc, load8(kh + j * slot_stride + 8 * c), part[j]);
        }
        _mm256_store_ps(weights + 8 * hq, _mm256_mul_ps(lanes_transpose_sum8(part), _mm256_set1_ps(scale)));
      }
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // online softmax; heads are independent chains
        const int64_t n = head_keys<Chain>(n_chunk, base, lo, head_stop, hq);
        if (Chain && n <= 0) continue;
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
        const __m256 score = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), _mm256_load_ps(weights + 8 * hq), valid);
        const float chunk_max = std::max(run_max[hq], lanes_max8(score));
        const __m256 w = _mm256_and_ps(valid, fast_exp8(_mm256_sub_ps(score, _mm256_set1_ps(chunk_max))));
        correction[hq] = fast_exp(run_max[hq] - chunk_max);
        run_max[hq] = chunk_max;
        run_sum[hq] = run_sum[hq] * correction[hq] + lanes_add8(w);
        _mm256_store_ps(weights + 8 * hq, w);
      }
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // weighted V rows, SLICE registers of the accumulator at a time
        const int64_t n = head_keys<Chain>(n_chunk, base, lo, head_stop, hq);
        if (Chain && n <= 0) continue;
        const T* vh = vb + lo * slot_stride + kv_offset[hq];
        const float* wh = weights + 8 * hq;
        const __m256 fix = _mm256_set1_ps(correction[hq]);
        for (int s = 0; s < C; s += SLICE) {
          float* ah = acc + hq * dim + 8 * s;
          __m256 sum[SLICE];
          for (int c = 0; c < SLICE; ++c) sum[c] = _mm256_mul_ps(_mm256_loadu_ps(ah + 8 * c), fix);
          for (int64_t j = 0; j < n; ++j) {
            const __m256 wj = _mm256_set1_ps(wh[j]);
            const T* vr = vh + j * slot_stride + 8 * s;
            for (int c = 0; c < SLICE; ++c) sum[c] = _mm256_fmadd_ps(wj, load8(vr + 8 * c), sum[c]);
          }
          for (int c = 0; c < SLICE; ++c) _mm256_storeu_ps(ah + 8 * c, sum[c]);
        }
      }
    }
  }
}
#endif

// The intrinsics paths' type (attend_sequence_avx512 / _avx2), so decode_all can hold one where neither is compiled in.
template <typename T>
using FastPath = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, const int64_t*,
                          int64_t, int64_t, float, float*, float*, float*, float*, float*, const int64_t*);

// Whether float16 and bfloat16 caches are read (by an intrinsics path: AVX-512 or AVX2) at this head size.
bool reads_16bit(int64_t dim) {
  return (BLOCKSERVE_AVX512 || BLOCKSERVE_AVX2) && (dim == 64 || dim == 128 || dim == 256);
}

// Decode batches of up to this many sequences split on the task pool (decode_all): the row count up
// to which the float32 blocks matmuls run there too (MAX_ROWS in models/quantized_linear.py), per build.
constexpr int64_t kPoolSeqs = BLOCKSERVE_AVX512 ? 128 : 64;
int64_t pool_sequences() { return kPoolSeqs; }

// The most rows of a chain (decode_all) one work item takes: a verification of up to 16 drafts whole.
constexpr int64_t kChainRows = 17;

// Every sequence's decode, for a cache of element type T (float, at::Half or at::BFloat16).
// Sequence n's query heads are the n_heads * dim floats at qp + n * q_stride. sinks (nullptr: none):
// query head h's logit in the softmax's denominator, exp(sinks[h] - run_max) in the state's frame.
template <typename T>
static void decode_all(at::Tensor out, const float* qp, int64_t q_stride, int64_t n_seqs, int64_t n_heads,
                       at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                       at::Tensor key_start, at::Tensor seq_lens, float scale, const float* sinks = nullptr) {
  const int64_t dim = k_cache.size(3), block_size = k_cache.size(1), n_kv_heads = k_cache.size(2);
  const int64_t group = n_heads / n_kv_heads, width = block_table.size(1);  // query heads per KV head
  const int64_t slot_stride = n_kv_heads * dim;
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* starts = key_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();

  // The path for this head size: AVX-512 or AVX2 where compiled in (64, 128, 256), else the portable
  // one; `chained` is the fast path over the rows of a chain (below).
  FastPath<T> fast = nullptr, chained = nullptr;
#if BLOCKSERVE_AVX512
  fast = dim == 64 ? attend_sequence_avx512<T, 4> : dim == 128 ? attend_sequence_avx512<T, 8>
       : dim == 256 ? attend_sequence_avx512<T, 16> : nullptr;
  chained = dim == 64 ? attend_sequence_avx512<T, 4, true> : dim == 128 ? attend_sequence_avx512<T, 8, true>
          : dim == 256 ? attend_sequence_avx512<T, 16, true> : nullptr;
#elif BLOCKSERVE_AVX2
  fast = dim == 64 ? attend_sequence_avx2<T, 8> : dim == 128 ? attend_sequence_avx2<T, 16>
       : dim == 256 ? attend_sequence_avx2<T, 32> : nullptr;
  chained = dim == 64 ? attend_sequence_avx2<T, 8, true> : dim == 128 ? attend_sequence_avx2<T, 16, true>
          : dim == 256 ? attend_sequence_avx2<T, 32, true> : nullptr;
#endif
  auto portable = dim == 64 ? attend_sequence<64> : dim == 128 ? attend_sequence<128> : attend_sequence<0>;

  // Chains: a speculative verification's rows are decodes of one sequence at consecutive lengths (the
  // same key start and blocks, worker/input_batch.py). On a fast path a chain of up to kChainRows rows
  // is one work item per KV head: its rows' query heads read each K and V row once (a step verifying
  // k drafts read the request's cache k + 1 times). Each row's arithmetic is the same as alone, so the
  // grouping never changes a result: any sequences that look like a chain may be taken as one.
  std::vector<int64_t> chain_first;  // chain c: sequences [chain_first[c], chain_first[c + 1])
  for (int64_t n = 0; n < n_seqs; ++n) {
    const bool follows = chained != nullptr && n > 0 && n - chain_first.back() < kChainRows &&
                         starts[n] == starts[n - 1] && lens[n] == lens[n - 1] + 1 &&
                         std::equal(table + n * width, table + n * width + std::min(width, (lens[n] + block_size - 1) / block_size),
                                    table + (n - 1) * width);
    if (!follows) chain_first.push_back(n);
  }
  const int64_t n_chains = static_cast<int64_t>(chain_first.size());
  chain_first.push_back(n_seqs);
  int64_t longest = 1;
  for (int64_t c = 0; c < n_chains; ++c) longest = std::max(longest, chain_first[c + 1] - chain_first[c]);

  // One work item per sequence and KV head: the item's `group` query heads against that head's K/V
  // rows (read in order, block by block), so one sequence splits across threads too (a batch-1
  // step's attention ran on one core). Heads never interact, so a head's result is the same bits
  // whatever the split. Up to kPoolSeqs sequences, in tasks of >= ~2^17 key elements (~20 us), on
  // the task pool the quantized matmuls of such steps use (task_pool.h: one pool per process),
  // whose worker is still spinning from the last matmul: OpenMP would wake a sleeping thread
  // (~100 us) or, spinning, hold that worker's core. Larger batches run on OpenMP, in tasks of
  // >= ~2^20 key elements (~150 us; a pool worker spinning beside OpenMP's GEMM threads cost bench
  // throughput at batch 64 5-8%).
  int64_t keys = 0;
  for (int64_t n = 0; n < n_seqs; ++n) keys += lens[n] - starts[n];
  const int64_t items = n_chains * n_kv_heads;
  const int64_t per_item = std::max<int64_t>(1, keys * group * dim / std::max<int64_t>(1, n_chains));
  const auto body = [&](int64_t begin, int64_t end) {
    const int64_t heads = longest * group;  // an item's query heads: its rows' heads of one KV head
    std::vector<float> acc(heads * dim), score(group * block_size), run_max(heads), run_sum(heads), correction(heads);
    std::vector<float> chain_q(longest > 1 ? heads * dim : 0);  // a chain's query heads, row after row
    std::vector<int64_t> head_stop(heads);
    const std::vector<int64_t> kv_offset(heads, 0);  // K/V pointers below start at the item's head
    std::vector<float> weights_buffer(heads * 16 + 16);  // 16 scores, then weights, per head; 64-byte aligned
    float* weights = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(weights_buffer.data()) + 63) & ~uintptr_t{63});
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / n_kv_heads, kv = item % n_kv_heads;
      const int64_t first = chain_first[c], rows = chain_first[c + 1] - first;
      const T* kh = kp + kv * dim;
      const T* vh = vp + kv * dim;
      std::fill(acc.begin(), acc.begin() + rows * group * dim, 0.f);
      std::fill(run_max.begin(), run_max.begin() + rows * group, -FLT_MAX);
      std::fill(run_sum.begin(), run_sum.begin() + rows * group, 0.f);
      if (rows > 1) {
        for (int64_t r = 0; r < rows; ++r) {
          const float* qn = qp + (first + r) * q_stride + kv * group * dim;
          std::copy(qn, qn + group * dim, chain_q.data() + r * group * dim);
          std::fill(head_stop.begin() + r * group, head_stop.begin() + (r + 1) * group, lens[first + r]);
        }
        chained(chain_q.data(), kh, vh, table + first * width, starts[first], lens[first + rows - 1], rows * group,
                kv_offset.data(), block_size, slot_stride, scale, acc.data(), weights, correction.data(),
                run_max.data(), run_sum.data(), head_stop.data());
      } else {
        const float* qn = qp + first * q_stride + kv * group * dim;
        if (fast != nullptr)
          fast(qn, kh, vh, table + first * width, starts[first], lens[first], group, kv_offset.data(), block_size,
               slot_stride, scale, acc.data(), weights, correction.data(), run_max.data(), run_sum.data(), nullptr);
        else if constexpr (std::is_same_v<T, float>)
          portable(qn, kh, vh, table + first * width, starts[first], lens[first], group, group, dim, block_size,
                   slot_stride, scale, acc.data(), score.data(), run_max.data(), run_sum.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* on = op + (first + r) * n_heads * dim + kv * group * dim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t hq = r * group + g;
          const float sum = run_sum[hq] + (sinks != nullptr ? std::exp(sinks[kv * group + g] - run_max[hq]) : 0.f);
          const float inv = sum > 0.f ? 1.f / sum : 0.f;
          for (int64_t d = 0; d < dim; ++d) on[g * dim + d] = acc[hq * dim + d] * inv;
        }
      }
    }
  };
  if (n_seqs <= kPoolSeqs) {
    blockserve::for_each_range(items, std::max<int64_t>(1, (int64_t{1} << 17) / per_item), body);
  } else {
    at::parallel_for(0, items, std::max<int64_t>(1, (int64_t{1} << 20) / per_item), body);
  }
}

// What both entry points require of the cache and the per-sequence tensors.
static void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                        const at::Tensor& key_start, const at::Tensor& seq_lens, int64_t n_seqs,
                        int64_t n_heads, const char* name) {
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), name, ": K and V caches of one dtype expected");
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16,
              name, ": float32, float16 or bfloat16 caches expected");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), name, ": K and V caches of one shape expected");
  TORCH_CHECK(block_table.dtype() == at::kLong && key_start.dtype() == at::kLong &&
                  seq_lens.dtype() == at::kLong,
              name, ": int64 block_table, key_start and seq_lens expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous() &&
                  key_start.is_contiguous() && seq_lens.is_contiguous(),
              name, ": contiguous tensors expected");
  TORCH_CHECK(block_table.size(0) >= n_seqs && key_start.numel() >= n_seqs && seq_lens.numel() >= n_seqs,
              name, ": a block table row, key_start and seq_len per sequence expected");
  TORCH_CHECK(n_heads % k_cache.size(2) == 0, name, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || reads_16bit(k_cache.size(3)),
              name, ": a float16 or bfloat16 cache needs AVX-512 or AVX2 (+ FMA, F16C) and head size 64, 128 or 256");
}

template <typename... Args>
static void dispatch_cache(const at::Tensor& k_cache, Args&&... args) {
  if (k_cache.scalar_type() == at::kFloat)
    decode_all<float>(std::forward<Args>(args)...);
  else if (k_cache.scalar_type() == at::kHalf)
    decode_all<at::Half>(std::forward<Args>(args)...);
  else  // bfloat16: check_cache admits no other type
    decode_all<at::BFloat16>(std::forward<Args>(args)...);
}

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens,
                            double scale) {
  if (k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn ||
      k_cache.scalar_type() == at::kByte)  // paged_decode_quantized.cpp
    return paged_decode_attention_quantized(out, q, k_cache, v_cache, block_table, key_start, seq_lens, scale);
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat,
              "paged_decode_attention: float32 q and out expected");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              "paged_decode_attention: contiguous q and out [N, Hq, D] expected");
  check_cache(k_cache, v_cache, block_table, key_start, seq_lens, q.size(0), q.size(1), "paged_decode_attention");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "paged_decode_attention: shape mismatch");
  dispatch_cache(k_cache, out, q.data_ptr<float>(), q.size(1) * q.size(2), q.size(0), q.size(1), k_cache, v_cache,
                 block_table, key_start, seq_lens, static_cast<float>(scale));
}

// paged_decode_attention with attention sinks: sinks [Hq] float32, each query head's logit added to
// its softmax's denominator (weighing no value).
void paged_decode_attention_sinks(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens, double scale,
                                  at::Tensor sinks) {
  const char* name = "paged_decode_attention_sinks";
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat, name, ": float32 q and out expected");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              name, ": contiguous q and out [N, Hq, D] expected");
  check_cache(k_cache, v_cache, block_table, key_start, seq_lens, q.size(0), q.size(1), name);
  TORCH_CHECK(k_cache.size(3) == q.size(2), name, ": shape mismatch");
  TORCH_CHECK(sinks.dtype() == at::kFloat && sinks.is_contiguous() && sinks.dim() == 1 && sinks.size(0) == q.size(1),
              name, ": contiguous float32 sinks [Hq] expected");
  dispatch_cache(k_cache, out, q.data_ptr<float>(), q.size(1) * q.size(2), q.size(0), q.size(1), k_cache, v_cache,
                 block_table, key_start, seq_lens, static_cast<float>(scale), sinks.data_ptr<float>());
}

// A decode-only step of a rotate_half RoPE attention layer in one call. qkv [N, (Hq + 2 Hkv) D]
// holds q | k | v of each sequence's one new token: q and k are rotated in place (cos, sin
// [N, D / 2]), k and v are written to slot slot_mapping[n] of the caches (rounded to the cache's
// dtype, as a copy would), then out [N, Hq, D] = paged_decode_attention over the caches. Every
// write lands before any sequence is attended.
void rotary_decode_attention(at::Tensor out, at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                             at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                             at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens,
                             int64_t n_heads, double scale) {
  if (k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn ||
      k_cache.scalar_type() == at::kByte)  // paged_decode_quantized.cpp
    return rotary_decode_attention_quantized(out, qkv, cos, sin, k_cache, v_cache, slot_mapping, block_table, key_start,
                                        seq_lens, n_heads, scale);
  const char* name = "rotary_decode_attention";
  TORCH_CHECK(qkv.dtype() == at::kFloat && out.dtype() == at::kFloat && cos.dtype() == at::kFloat &&
                  sin.dtype() == at::kFloat,
              name, ": float32 qkv, cos, sin and out expected");
  check_cache(k_cache, v_cache, block_table, key_start, seq_lens, qkv.size(0), n_heads, name);
  const int64_t n_seqs = qkv.size(0), n_kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t q_size = n_heads * dim, kv_size = n_kv_heads * dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == q_size + 2 * kv_size && qkv.stride(1) == 1,
              name, ": qkv [N, (Hq + 2 Hkv) D] with contiguous rows expected");
  TORCH_CHECK(out.is_contiguous() && out.numel() == n_seqs * q_size, name, ": contiguous out [N, Hq, D] expected");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n_seqs && cos.size(1) == dim / 2 && sin.sizes() == cos.sizes() &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && dim % 2 == 0,
              name, ": cos, sin [N, D / 2] expected");
  TORCH_CHECK(slot_mapping.dtype() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == n_seqs,
              name, ": an int64 slot per sequence expected");
  float* qkvp = qkv.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t n = 0; n < n_seqs; ++n)
    TORCH_CHECK(slots[n] >= 0 && slots[n] < num_slots, name, ": slot ", slots[n], " outside the cache (", num_slots,
                " slots)");
  auto write = [&](auto* kc, auto* vc) {
    using T = std::remove_pointer_t<decltype(kc)>;
    for (int64_t n = 0; n < n_seqs; ++n) {  // a few KB per sequence: not worth a parallel region
      float* row = qkvp + n * qkv.stride(0);
      rotate_half_heads(row, n_heads + n_kv_heads, dim, cos.data_ptr<float>() + n * cos.stride(0),
                        sin.data_ptr<float>() + n * sin.stride(0));
      T* kd = kc + slots[n] * kv_size;
      T* vd = vc + slots[n] * kv_size;
      for (int64_t i = 0; i < kv_size; ++i) {
        kd[i] = static_cast<T>(row[q_size + i]);
        vd[i] = static_cast<T>(row[q_size + kv_size + i]);
      }
    }
  };
  if (k_cache.scalar_type() == at::kFloat)
    write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (k_cache.scalar_type() == at::kHalf)
    write(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else
    write(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  dispatch_cache(k_cache, out, static_cast<const float*>(qkvp), qkv.stride(0), n_seqs, n_heads, k_cache, v_cache,
                 block_table, key_start, seq_lens, static_cast<float>(scale));
}

}  // namespace blockserve
