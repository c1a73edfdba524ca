// The per-token recurrences of the state layers' decode rows (attention/state_decodes.py), one call
// for all of a step's rows: the gated delta rule (Gated DeltaNet: a decay per head; KDA: per key
// channel) and Mamba2's SSD step. A row starts from a state slot or from the state an earlier row
// of the call left (a speculative chain: `source`), so a verified request's k + 1 rows run in one
// call with no copy of a state between them. Each row's arithmetic is one fixed sequence of float
// operations on its own inputs and starting state, whatever the other rows: a token stepped in a
// chain gets the bits of the same token stepped alone.

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace blockserve {
namespace {

// source[p] >= 0: row p starts from after[source[p]] (an earlier row); < 0: from table[-source[p] - 1].
void check_rows(const at::Tensor& table, const at::Tensor& source, const at::Tensor& after, int64_t rows,
                const char* name) {
  TORCH_CHECK(table.dtype() == at::kFloat && after.dtype() == at::kFloat && table.is_contiguous() &&
                  after.is_contiguous(), name, ": float32 contiguous state table and after expected");
  TORCH_CHECK(source.dtype() == at::kLong && source.dim() == 1 && source.size(0) == rows && source.is_contiguous(),
              name, ": source must be int64 [rows]");
  TORCH_CHECK(after.size(0) == rows && table.dim() == after.dim(), name, ": after must be [rows, *state shape]");
  for (int64_t d = 1; d < table.dim(); ++d)
    TORCH_CHECK(table.size(d) == after.size(d), name, ": the table's and after's state shapes differ");
  const int64_t* src = source.data_ptr<int64_t>();
  for (int64_t p = 0; p < rows; ++p)
    TORCH_CHECK(src[p] < p && -src[p] - 1 < table.size(0), name, ": row ", p, "'s source ", src[p],
                " is neither an earlier row nor a slot");
}

void check_rows_of(const at::Tensor& x, int64_t rows, int64_t heads, int64_t width, const char* what) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 3 && x.size(0) == rows &&
                  x.size(1) == heads && x.size(2) == width, what, " must be float32 contiguous [", rows, ", ",
              heads, ", ", width, "]");
}

const float* start_state(const float* table, float* after, int64_t src, int64_t state_size) {
  return src >= 0 ? after + src * state_size : table + (-src - 1) * state_size;
}

// Heads split over threads only when a call holds much work (a thread's wake-up costs ~100 us).
int64_t heads_per_task(int64_t rows, int64_t state_elems) {
  return std::max<int64_t>(1, (int64_t{1} << 21) / std::max<int64_t>(1, rows * state_elems));
}

}  // namespace

void delta_rule_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, const at::Tensor& table, const at::Tensor& source, at::Tensor out,
                     at::Tensor after) {
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  check_rows(table, source, after, rows, "delta_rule_rows");
  check_rows_of(q, rows, heads, dk, "q");
  check_rows_of(k, rows, heads, dk, "k");
  check_rows_of(v, rows, heads, dv, "v");
  check_rows_of(out, rows, heads, dv, "out");
  const bool per_channel = g.dim() == 3;
  if (per_channel)
    check_rows_of(g, rows, heads, dk, "g");
  else
    TORCH_CHECK(g.dtype() == at::kFloat && g.is_contiguous() && g.dim() == 2 && g.size(0) == rows &&
                g.size(1) == heads, "g must be float32 contiguous [rows, heads] or [rows, heads, Dk]");
  TORCH_CHECK(beta.dtype() == at::kFloat && beta.is_contiguous() && beta.dim() == 2 && beta.size(0) == rows &&
              beta.size(1) == heads, "beta must be float32 contiguous [rows, heads]");
  TORCH_CHECK(after.dim() == 4 && after.size(1) == heads && after.size(2) == dk && after.size(3) == dv,
              "after must be [rows, heads, Dk, Dv]");
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *tp = table.data_ptr<float>();
  const int64_t* src = source.data_ptr<int64_t>();
  float *op = out.data_ptr<float>(), *ap = after.data_ptr<float>();
  const int64_t state_size = heads * dk * dv;
  at::parallel_for(0, heads, heads_per_task(rows, dk * dv), [&](int64_t h0, int64_t h1) {
    std::vector<float> pred(dv), delta(dv);
    for (int64_t p = 0; p < rows; ++p) {
      const float* from = start_state(tp, ap, src[p], state_size);
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t qk = (p * heads + h) * dk, vo = (p * heads + h) * dv;
        const float* s0 = from + h * dk * dv;
        float* s = ap + p * state_size + h * dk * dv;
        // S = exp(g) S; pred = S^T k
        std::fill(pred.begin(), pred.end(), 0.0f);
        const float head_decay = per_channel ? 0.0f : std::exp(gp[p * heads + h]);
        for (int64_t i = 0; i < dk; ++i) {
          const float decay = per_channel ? std::exp(gp[qk + i]) : head_decay, ki = kp[qk + i];
          const float* __restrict__ si0 = s0 + i * dv;
          float* __restrict__ si = s + i * dv;
          float* __restrict__ pr = pred.data();
          for (int64_t j = 0; j < dv; ++j) {
            si[j] = si0[j] * decay;
            pr[j] += si[j] * ki;
          }
        }
        // delta = beta (v - pred); S += k delta^T; o = S^T q
        const float b = bp[p * heads + h];
        float* o = op + vo;
        for (int64_t j = 0; j < dv; ++j) {
          delta[j] = (vp[vo + j] - pred[j]) * b;
          o[j] = 0.0f;
        }
        for (int64_t i = 0; i < dk; ++i) {
          const float ki = kp[qk + i], qi = qp[qk + i];
          float* __restrict__ si = s + i * dv;
          float* __restrict__ oj = o;
          const float* __restrict__ dj = delta.data();
          for (int64_t j = 0; j < dv; ++j) {
            si[j] += ki * dj[j];
            oj[j] += si[j] * qi;
          }
        }
      }
    }
  });
}

void ssd_rows(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
              const at::Tensor& C, const at::Tensor& D, const at::Tensor& table, const at::Tensor& source,
              at::Tensor out, at::Tensor after) {
  const int64_t rows = x.size(0), heads = x.size(1), hd = x.size(2), n = B.size(2);
  check_rows(table, source, after, rows, "ssd_rows");
  check_rows_of(x, rows, heads, hd, "x");
  check_rows_of(B, rows, heads, n, "B");
  check_rows_of(C, rows, heads, n, "C");
  check_rows_of(out, rows, heads, hd, "out");
  TORCH_CHECK(dt.dtype() == at::kFloat && dt.is_contiguous() && dt.dim() == 2 && dt.size(0) == rows &&
              dt.size(1) == heads, "dt must be float32 contiguous [rows, heads]");
  TORCH_CHECK(A.dtype() == at::kFloat && D.dtype() == at::kFloat && A.is_contiguous() && D.is_contiguous() &&
              A.numel() == heads && D.numel() == heads, "A and D must be float32 [heads]");
  TORCH_CHECK(after.dim() == 4 && after.size(1) == heads && after.size(2) == hd && after.size(3) == n,
              "after must be [rows, heads, head_dim, state_size]");
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *Dp = D.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  const int64_t* src = source.data_ptr<int64_t>();
  float *op = out.data_ptr<float>(), *ap = after.data_ptr<float>();
  const int64_t state_size = heads * hd * n;
  at::parallel_for(0, heads, heads_per_task(rows, hd * n), [&](int64_t h0, int64_t h1) {
    for (int64_t p = 0; p < rows; ++p) {
      const float* from = start_state(tp, ap, src[p], state_size);
      for (int64_t h = h0; h < h1; ++h) {
        // h = exp(dt A) h + (dt x) B^T;  y = h C + D x
        const float step = dtp[p * heads + h], decay = std::exp(step * Ap[h]);
        const float *b = Bp + (p * heads + h) * n, *c = Cp + (p * heads + h) * n, *xh = xp + (p * heads + h) * hd;
        const float* s0 = from + h * hd * n;
        float* s = ap + p * state_size + h * hd * n;
        float* y = op + (p * heads + h) * hd;
        for (int64_t i = 0; i < hd; ++i) {
          const float write = step * xh[i];
          const float* __restrict__ si0 = s0 + i * n;
          float* __restrict__ si = s + i * n;
          float read = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            si[j] = si0[j] * decay + write * b[j];
            read += si[j] * c[j];
          }
          y[i] = read + Dp[h] * xh[i];
        }
      }
    }
  });
}

}  // namespace blockserve
