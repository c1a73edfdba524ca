// Decode attention read in place from the paged KV cache: one query token per sequence, no
// gather copy, no padding. Compiled on first use for the machine it runs on (native.py).
//
// For sequence n and query head hq (KV head h = hq / G, G = Hq / Hkv):
//     out[n, hq] = sum_p softmax_p(scale * q[n, hq] . K[p, h]) V[p, h],   p in [key_start[n], seq_len[n])
// where position p lives at k_cache[block_table[n, p / bs], p % bs, h]. Only slots of positions
// below seq_len are read (never an unwritten slot). The softmax runs online, block by block, so
// K and V are read once each.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <vector>

#include "fast_exp.h"

// The decode of one sequence: all its query heads against its positions [start, stop), block by
// block. DIM is the head size when known at compile time (loops fully unrolled), else 0.
template <int64_t DIM>
static void attend_sequence(const float* __restrict qn, const float* kp, const float* vp, const int64_t* table,
                            int64_t start, int64_t stop, int64_t n_heads, int64_t group, int64_t runtime_dim,
                            int64_t block_size, int64_t slot_stride, float scale, float* __restrict acc,
                            float* __restrict score, float* __restrict run_max, float* __restrict run_sum,
                            float* __restrict out) {
  const int64_t dim = DIM > 0 ? DIM : runtime_dim;
  const int64_t block_stride = block_size * slot_stride;
  std::fill(acc, acc + n_heads * dim, 0.f);
  std::fill(run_max, run_max + n_heads, -FLT_MAX);
  std::fill(run_sum, run_sum + n_heads, 0.f);
  for (int64_t base = start - start % block_size; base < stop; base += block_size) {
    if (base + block_size < stop) {  // the next block's K and V, fetched while this one is used
      const char* kn = reinterpret_cast<const char*>(kp + table[base / block_size + 1] * block_stride);
      const char* vn = reinterpret_cast<const char*>(vp + table[base / block_size + 1] * block_stride);
      for (int64_t byte = 0; byte < block_stride * 4; byte += 64) {
        __builtin_prefetch(kn + byte);
        __builtin_prefetch(vn + byte);
      }
    }
    const int64_t lo = std::max(start, base) - base, hi = std::min(stop, base + block_size) - base;
    const float* __restrict kb = kp + table[base / block_size] * block_stride;
    const float* __restrict vb = vp + table[base / block_size] * block_stride;
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
  for (int64_t hq = 0; hq < n_heads; ++hq) {
    const float inv = run_sum[hq] > 0.f ? 1.f / run_sum[hq] : 0.f;
    for (int64_t d = 0; d < dim; ++d) out[hq * dim + d] = acc[hq * dim + d] * inv;
  }
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor key_start, torch::Tensor seq_lens,
                            double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_decode_attention: float32 tensors expected");
  TORCH_CHECK(block_table.dtype() == torch::kInt64 && key_start.dtype() == torch::kInt64 &&
                  seq_lens.dtype() == torch::kInt64,
              "paged_decode_attention: int64 block_table, key_start and seq_lens expected");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_table.is_contiguous() && key_start.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors expected");
  const int64_t n_seqs = q.size(0), n_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), n_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && n_heads % n_kv_heads == 0, "paged_decode_attention: shape mismatch");
  const int64_t group = n_heads / n_kv_heads, width = block_table.size(1);  // query heads per KV head
  const int64_t slot_stride = n_kv_heads * dim;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* starts = key_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // One work item per sequence: its blocks are read whole and in order (K then V rows of every head).
  at::parallel_for(0, n_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(n_heads * dim), score(n_heads * block_size), run_max(n_heads), run_sum(n_heads);
    for (int64_t n = begin; n < end; ++n) {
      auto attend = dim == 64 ? attend_sequence<64> : dim == 128 ? attend_sequence<128> : attend_sequence<0>;
      attend(qp + n * n_heads * dim, kp, vp, table + n * width, starts[n], lens[n], n_heads, group, dim, block_size,
             slot_stride, fscale, acc.data(), score.data(), run_max.data(), run_sum.data(), op + n * n_heads * dim);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache, in place (out, q, k_cache, v_cache, block_table, key_start, "
        "seq_lens, scale)");
}
