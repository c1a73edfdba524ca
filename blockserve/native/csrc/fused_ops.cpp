// Elementwise steps of a decoder layer fused into one pass each, so a decode step spends its
// time in the matmuls rather than in ~30 small tensor ops per layer. Each matches the PyTorch
// expression in its comment (float32; the reductions are summed in a different order).

#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "fast_exp.h"
#include "rotary.h"

namespace blockserve {

// Rows per parallel task: at least ~512k floats (~150 us of work; waking a sleeping thread costs
// ~100 us on a VM), so a decode batch or a short prefill runs inline on the calling thread.
static int64_t rows_per_task(int64_t floats_per_row) {
  constexpr int64_t kMinFloatsPerTask = 1 << 19;
  return std::max<int64_t>(1, kMinFloatsPerTask / std::max<int64_t>(1, floats_per_row));
}

static void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat, name, ": float32 expected");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

// residual += x; x = rms_norm(residual) * weight        (x, residual [T, H], both updated in place)
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check(x, "x"); check(residual, "residual"); check(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.numel() == x.size(1), "add_rms_norm_: shapes");
  const int64_t rows = x.size(0), hidden = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, rows_per_task(2 * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict xr = xp + t * xs;
      float* __restrict rr = rp + t * rs;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        rr[i] += xr[i];
        squares += rr[i] * rr[i];
      }
      const float inv = 1.f / std::sqrt(squares / hidden + static_cast<float>(eps));
      for (int64_t i = 0; i < hidden; ++i) xr[i] = wp[i] * (rr[i] * inv);
    }
  });
}

// The first `heads` heads of each row of qkv [T, >= heads * D] rotated in place (rotate_half
// layout): x1, x2 = halves; x1' = x1 cos - x2 sin; x2' = x2 cos + x1 sin; cos, sin [T, D / 2].
void rotary_(at::Tensor qkv, int64_t heads, int64_t head_dim, at::Tensor cos, at::Tensor sin) {
  check(qkv, "qkv"); check(cos, "cos"); check(sin, "sin");
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) >= heads * head_dim && head_dim % 2 == 0, "rotary_: shapes");
  TORCH_CHECK(cos.size(0) == rows && cos.size(1) == head_dim / 2 && sin.sizes() == cos.sizes(), "rotary_: cos/sin shapes");
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t qs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, rows, rows_per_task(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rotate_half_heads(qp + t * qs, heads, head_dim, cp + t * cs, sp + t * ss);
  });
}

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: [T, 2 * I] expected");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, rows_per_task(3 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict g = gp + t * gs;
      const float* __restrict u = g + inter;
      float* __restrict o = op + t * inter;
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace blockserve
