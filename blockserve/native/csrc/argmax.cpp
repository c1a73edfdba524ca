// Greedy sampling's argmax over a row of logits, without an OpenMP region: torch's max(dim) at
// one row tracks indices in scalar code (~30 us over a 49k vocabulary) and, at two threads with
// OMP_WAIT_POLICY=PASSIVE, can pay a sleeping thread's wake-up besides (~110 us in a decode step).
// Two vector passes instead: the row's max (NaN noted), then the first index holding it. The
// answer is torch's: the first maximum; the first NaN where the row has one.

#include "kernels.h"
#include "row_scan.h"
#include <ATen/Parallel.h>

#include <algorithm>

namespace blockserve {

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
