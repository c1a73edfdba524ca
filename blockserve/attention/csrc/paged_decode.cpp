// Decode attention read in place from the paged KV cache: one query token per sequence, no
// gather copy, no padding. Compiled on first use for the machine it runs on (native.py).
//
// For sequence n and query head hq (KV head h = hq / G, G = Hq / Hkv):
//     out[n, hq] = sum_p softmax_p(scale * q[n, hq] . K[p, h]) V[p, h],   p in [key_start[n], seq_len[n])
// where position p lives at k_cache[block_table[n, p / bs], p % bs, h]. Only slots of positions
// below seq_len are read (never an unwritten slot). The softmax runs online, block by block, so
// K and V are read once each.
//
// Two implementations of one sequence's decode: a portable one the compiler vectorises (float32
// caches), and, where AVX-512 is available and the head size is 64, 128 or 256, one written with
// intrinsics that scores 16 keys at a time (each key's partial dot products summed across lanes by
// one transpose), runs the softmax on those 16 lanes, and also reads float16 and bfloat16 caches
// (widened to float32 in registers; all arithmetic stays float32).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <type_traits>
#include <vector>

#include "fast_exp.h"

#if defined(__AVX512F__)
#define BLOCKSERVE_AVX512 1
#else
#define BLOCKSERVE_AVX512 0
#endif

// Where the block holding position `base` keeps its K and V rows; the next block's (if the
// sequence reaches it) are prefetched, to arrive while this one is used.
template <typename T>
struct BlockRows {
  const T* k;
  const T* v;
};

template <typename T>
static inline BlockRows<T> block_rows(const T* kp, const T* vp, const int64_t* table, int64_t base, int64_t stop,
                                      int64_t block_size, int64_t block_stride) {
  if (base + block_size < stop) {
    const char* kn = reinterpret_cast<const char*>(kp + table[base / block_size + 1] * block_stride);
    const char* vn = reinterpret_cast<const char*>(vp + table[base / block_size + 1] * block_stride);
    for (int64_t byte = 0; byte < block_stride * static_cast<int64_t>(sizeof(T)); byte += 64) {
      __builtin_prefetch(kn + byte);
      __builtin_prefetch(vn + byte);
    }
  }
  const int64_t offset = table[base / block_size] * block_stride;
  return {kp + offset, vp + offset};
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
  for (int64_t base = start - start % block_size; base < stop; base += block_size) {
    const BlockRows<float> rows = block_rows(kp, vp, table, base, stop, block_size, block_stride);
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

// lane j of the result = the sum of v[j]'s 16 lanes. Halves, then quarters, then pairs of lanes
// are added across vectors (8 + 4 + 2 + 1 shuffle pairs instead of 16 separate reductions); the
// last add leaves key 4m + k in lane 4k + m, which the final permute undoes.
static inline __m512 transpose_sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
  const __m512 mixed = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), mixed);
}

// The same contract as attend_sequence, head size 16 * C, keys taken 16 at a time: for each query
// head, the chunk's 16 scores land in one vector, the online softmax runs on it, and its weights
// scale the V rows into the head's accumulator (kept in registers for the chunk).
template <typename T, int C>
static void attend_sequence_avx512(const float* __restrict qn, const T* kp, const T* vp, const int64_t* table,
                                   int64_t start, int64_t stop, int64_t n_heads, const int64_t* kv_offset,
                                   int64_t block_size, int64_t slot_stride, float scale, float* __restrict acc,
                                   float* __restrict weights, float* __restrict correction,
                                   float* __restrict run_max, float* __restrict run_sum) {
  constexpr int64_t dim = 16 * C;
  const int64_t block_stride = block_size * slot_stride;
  for (int64_t base = start - start % block_size; base < stop; base += block_size) {
    const BlockRows<T> rows = block_rows(kp, vp, table, base, stop, block_size, block_stride);
    const T* __restrict kb = rows.k;
    const T* __restrict vb = rows.v;
    const int64_t hi = std::min(stop, base + block_size) - base;
    for (int64_t lo = std::max(start, base) - base; lo < hi; lo += 16) {  // keys [lo, lo + n) of the block
      const int64_t n = std::min<int64_t>(16, hi - lo);
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // scores: every head's 16 in one vector
        const T* kh = kb + lo * slot_stride + kv_offset[hq];
        __m512 q[C], part[16];
        for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qn + hq * dim + 16 * c);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {  // only written slots are read: keys past n stay zero
          part[j] = _mm512_setzero_ps();
          if (j < n)
            for (int c = 0; c < C; ++c) part[j] = _mm512_fmadd_ps(q[c], load16(kh + j * slot_stride + 16 * c), part[j]);
        }
        _mm512_store_ps(weights + 16 * hq, _mm512_mul_ps(transpose_sum16(part), _mm512_set1_ps(scale)));
      }
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // online softmax; heads are independent chains
        const __m512 score = _mm512_load_ps(weights + 16 * hq);
        const float chunk_max = std::max(run_max[hq], _mm512_mask_reduce_max_ps(valid, score));
        const __m512 w = _mm512_maskz_mov_ps(valid, fast_exp16(_mm512_sub_ps(score, _mm512_set1_ps(chunk_max))));
        correction[hq] = fast_exp(run_max[hq] - chunk_max);
        run_max[hq] = chunk_max;
        run_sum[hq] = run_sum[hq] * correction[hq] + _mm512_reduce_add_ps(w);
        _mm512_store_ps(weights + 16 * hq, w);
      }
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // weighted V rows; even and odd keys in two chains
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

// attend_sequence_avx512's type, so decode_all can hold one where that path is not compiled in.
template <typename T>
using FastPath = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, const int64_t*,
                          int64_t, int64_t, float, float*, float*, float*, float*, float*);

// Whether float16 and bfloat16 caches are read (by the AVX-512 path only) at this head size.
static bool reads_16bit(int64_t dim) { return BLOCKSERVE_AVX512 && (dim == 64 || dim == 128 || dim == 256); }

// Every sequence's decode, for a cache of element type T (float, at::Half or at::BFloat16).
template <typename T>
static void decode_all(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor block_table, torch::Tensor key_start, torch::Tensor seq_lens, float scale) {
  const int64_t n_seqs = q.size(0), n_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), n_kv_heads = k_cache.size(2);
  const int64_t group = n_heads / n_kv_heads, width = block_table.size(1);  // query heads per KV head
  const int64_t slot_stride = n_kv_heads * dim;
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* starts = key_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();

  // The path for this head size: AVX-512 where compiled in (64, 128, 256), else the portable one.
  FastPath<T> fast = nullptr;
#if BLOCKSERVE_AVX512
  fast = dim == 64 ? attend_sequence_avx512<T, 4> : dim == 128 ? attend_sequence_avx512<T, 8>
       : dim == 256 ? attend_sequence_avx512<T, 16> : nullptr;
#endif
  auto portable = dim == 64 ? attend_sequence<64> : dim == 128 ? attend_sequence<128> : attend_sequence<0>;

  // One work item per sequence: its blocks are read whole and in order (K then V rows of every head).
  at::parallel_for(0, n_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(n_heads * dim), score(n_heads * block_size), run_max(n_heads), run_sum(n_heads),
        correction(n_heads);
    std::vector<int64_t> kv_offset(n_heads);  // where query head hq's K/V row starts in a slot
    for (int64_t hq = 0; hq < n_heads; ++hq) kv_offset[hq] = (hq / group) * dim;
    std::vector<float> weights_buffer(n_heads * 16 + 16);  // 16 scores, then weights, per head; 64-byte aligned
    float* weights = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(weights_buffer.data()) + 63) & ~uintptr_t{63});
    for (int64_t n = begin; n < end; ++n) {
      const float* qn = qp + n * n_heads * dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -FLT_MAX);
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      if (fast != nullptr)
        fast(qn, kp, vp, table + n * width, starts[n], lens[n], n_heads, kv_offset.data(), block_size, slot_stride,
             scale, acc.data(), weights, correction.data(), run_max.data(), run_sum.data());
      else if constexpr (std::is_same_v<T, float>)
        portable(qn, kp, vp, table + n * width, starts[n], lens[n], n_heads, group, dim, block_size, slot_stride, scale,
                 acc.data(), score.data(), run_max.data(), run_sum.data());
      float* on = op + n * n_heads * dim;
      for (int64_t hq = 0; hq < n_heads; ++hq) {
        const float inv = run_sum[hq] > 0.f ? 1.f / run_sum[hq] : 0.f;
        for (int64_t d = 0; d < dim; ++d) on[hq * dim + d] = acc[hq * dim + d] * inv;
      }
    }
  });
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor key_start, torch::Tensor seq_lens,
                            double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_decode_attention: float32 q and out expected");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "paged_decode_attention: K and V caches of one dtype expected");
  TORCH_CHECK(block_table.dtype() == torch::kInt64 && key_start.dtype() == torch::kInt64 &&
                  seq_lens.dtype() == torch::kInt64,
              "paged_decode_attention: int64 block_table, key_start and seq_lens expected");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_table.is_contiguous() && key_start.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors expected");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "paged_decode_attention: shape mismatch");
  const float fscale = static_cast<float>(scale);
  TORCH_CHECK(k_cache.dtype() == torch::kFloat32 || reads_16bit(q.size(2)),
              "paged_decode_attention: a float16 or bfloat16 cache needs AVX-512 and head size 64, 128 or 256");
  if (k_cache.dtype() == torch::kFloat32)
    decode_all<float>(out, q, k_cache, v_cache, block_table, key_start, seq_lens, fscale);
  else if (k_cache.dtype() == torch::kFloat16)
    decode_all<at::Half>(out, q, k_cache, v_cache, block_table, key_start, seq_lens, fscale);
  else if (k_cache.dtype() == torch::kBFloat16)
    decode_all<at::BFloat16>(out, q, k_cache, v_cache, block_table, key_start, seq_lens, fscale);
  else
    TORCH_CHECK(false, "paged_decode_attention: float32, float16 or bfloat16 caches expected");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("reads_16bit", &reads_16bit, "whether float16 / bfloat16 caches are read at this head size");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache, in place (out, q, k_cache, v_cache, block_table, key_start, "
        "seq_lens, scale)");
}
