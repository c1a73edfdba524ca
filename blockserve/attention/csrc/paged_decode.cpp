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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// exp(x) for x <= 0 to ~2 ulp (Cephes' expf polynomial on x = k ln2 + r), written so that the
// compiler vectorises a loop of it; std::exp is a scalar call and dominated the kernel.
static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) ~ 1.6e-38: anything below weighs nothing
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
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
  const int64_t slot_stride = n_kv_heads * dim, block_stride = block_size * slot_stride;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* starts = key_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // One work item per sequence: its blocks are read whole and in order (K then V rows of every
  // head), and the next block is prefetched while this one is used.
  at::parallel_for(0, n_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(n_heads * dim), score(n_heads * block_size), run_max(n_heads), run_sum(n_heads);
    for (int64_t n = begin; n < end; ++n) {
      const float* qn = qp + n * n_heads * dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -FLT_MAX);
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      const int64_t start = starts[n], stop = lens[n];
      for (int64_t base = start - start % block_size; base < stop; base += block_size) {
        const int64_t block = table[n * width + base / block_size];
        if (base + block_size < stop) {
          const int64_t next = table[n * width + base / block_size + 1];
          const char* kn = reinterpret_cast<const char*>(kp + next * block_stride);
          const char* vn = reinterpret_cast<const char*>(vp + next * block_stride);
          for (int64_t byte = 0; byte < block_stride * 4; byte += 64) {
            __builtin_prefetch(kn + byte);
            __builtin_prefetch(vn + byte);
          }
        }
        const int64_t lo = std::max(start, base) - base, hi = std::min(stop, base + block_size) - base;
        const float* kb = kp + block * block_stride;
        const float* vb = vp + block * block_stride;
        for (int64_t j = lo; j < hi; ++j) {
          for (int64_t hq = 0; hq < n_heads; ++hq) {
            const float* kr = kb + j * slot_stride + (hq / group) * dim;
            const float* qh = qn + hq * dim;
            float dot = 0.f;
            for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kr[d];
            score[hq * block_size + j] = dot * fscale;
          }
        }
        for (int64_t hq = 0; hq < n_heads; ++hq) {
          float* sh = score.data() + hq * block_size;
          float block_max = run_max[hq];
          for (int64_t j = lo; j < hi; ++j) block_max = std::max(block_max, sh[j]);
          float sum = 0.f;
          for (int64_t j = lo; j < hi; ++j) {
            sh[j] = exp_nonpositive(sh[j] - block_max);
            sum += sh[j];
          }
          const float correction = exp_nonpositive(run_max[hq] - block_max);
          float* ah = acc.data() + hq * dim;
          for (int64_t d = 0; d < dim; ++d) ah[d] *= correction;
          run_max[hq] = block_max;
          run_sum[hq] = run_sum[hq] * correction + sum;
        }
        for (int64_t j = lo; j < hi; ++j) {
          for (int64_t hq = 0; hq < n_heads; ++hq) {
            const float w = score[hq * block_size + j];
            const float* vr = vb + j * slot_stride + (hq / group) * dim;
            float* ah = acc.data() + hq * dim;
            for (int64_t d = 0; d < dim; ++d) ah[d] += w * vr[d];
          }
        }
      }
      for (int64_t hq = 0; hq < n_heads; ++hq) {
        float* o = op + (n * n_heads + hq) * dim;
        const float inv = run_sum[hq] > 0.f ? 1.f / run_sum[hq] : 0.f;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[hq * dim + d] * inv;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache, in place (out, q, k_cache, v_cache, block_table, key_start, "
        "seq_lens, scale)");
}
