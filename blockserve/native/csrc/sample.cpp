// Sampling one token per row from the tempered, filtered softmax of its logits, in one native call
// with no OpenMP region. worker/sampler.py's PyTorch path takes ~15 ops a step, each a pass over the
// vocabulary (one of them a sort when a top-p nucleus is wide); here a row costs a few passes.
//
// Per row: z = logits / temperature. Each filter keeps the tokens whose z is at or above a threshold,
// ties kept: top-k the k-th largest z; top-p (measured after top-k) the z of the token at which the
// kept tokens' probability, summed from the most likely down, first reaches p; min-p max z +
// log(min_p). So the three keep z >= the largest of their thresholds. The draw is inverse-CDF: the
// first token, in id order, at which the kept tokens' cumulative probability passes u times their
// sum, u the row's uniform number.
//
// The thresholds are found without sorting the row: the maxima of its blocks of kBlock tokens bound
// the k-th largest z from below (the k-th largest block maximum), so only the blocks reaching that
// bound are searched. Top-p looks for its nucleus among the kept tokens of top-k, or among the
// kTopPFirst most likely; where the nucleus is wider, by radix selection over the whole row
// (histograms of z's bits, weighted by probability).
//
// A row holding a NaN gets its first NaN's index and a row with no finite z token 0, as argmax would.

#include "fast_exp.h"
#include "kernels.h"
#include "row_scan.h"
#include "task_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace blockserve {

namespace {

// Order-preserving keys of floats: a < b (not NaN) exactly when key(a) < key(b).
inline uint32_t order_key(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

inline float from_key(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The scratch of one thread's rows, kept between calls (a row of a 49k vocabulary is ~200 KB a buffer).
struct Scratch {
  std::vector<float> z, e, block_max, values;
  std::vector<int32_t> candidates, next;
  std::vector<double> block_sums;
};

constexpr int64_t kBlock = 64;        // tokens per block whose maximum bounds the search
constexpr int64_t kTopPFirst = 256;   // top-p first looks for its nucleus among this many tokens
constexpr int64_t kDrawBlock = 512;   // the draw's blocks: their sums first, then one block's elements

// Into s.candidates, in id order, the tokens whose z may be among the `count` largest: every token of
// the blocks whose maximum reaches the count-th largest block maximum, where that is at least z_min
// (every token at or above z_min where there are fewer blocks than count).
void gather_candidates(const float* z, int64_t n, int64_t count, float z_min, Scratch& s) {
  const int64_t blocks = static_cast<int64_t>(s.block_max.size());
  float bound = z_min;
  if (count <= blocks) {
    s.values.assign(s.block_max.begin(), s.block_max.end());
    std::nth_element(s.values.begin(), s.values.begin() + (count - 1), s.values.end(), std::greater<float>());
    bound = std::max(bound, s.values[count - 1]);
  }
  s.candidates.clear();
  for (int64_t b = 0; b < blocks; ++b) {
    if (s.block_max[b] < bound) continue;
    for (int64_t j = b * kBlock, end = std::min(n, j + kBlock); j < end; ++j)
      if (z[j] >= bound) s.candidates.push_back(static_cast<int32_t>(j));
  }
}

// The k-th largest z of the candidates (which hold the k largest of the row, at least k tokens).
float kth_largest(const float* z, int64_t k, Scratch& s) {
  s.values.clear();
  for (const int32_t j : s.candidates) s.values.push_back(z[j]);
  std::nth_element(s.values.begin(), s.values.begin() + (k - 1), s.values.end(), std::greater<float>());
  return s.values[k - 1];
}

// The z at which the tokens' probabilities e, summed from the largest z down, first reach `target`
// (> 0): three histogram levels over z's bits (11, 11, 10), each narrowing the candidates to one
// bucket. Where rounding leaves the sum short of `target`, the smallest z with a positive e.
float select_by_mass(const float* z, const float* e, int64_t n, double target, Scratch& s) {
  const auto weight = [e](int64_t j) { return static_cast<double>(e[j]); };
  constexpr int kShifts[3] = {21, 10, 0};
  constexpr uint32_t kMasks[3] = {0x7FF, 0x7FF, 0x3FF};
  double histogram[2048];
  uint32_t prefix = 0;
  for (int level = 0; level < 3; ++level) {
    const int shift = kShifts[level];
    const uint32_t mask = kMasks[level];
    std::fill(histogram, histogram + mask + 1, 0.0);
    const auto count = [&](int64_t j) {
      if (const double w = weight(j); w > 0) histogram[(order_key(z[j]) >> shift) & mask] += w;
    };
    if (level == 0) {
      for (int64_t j = 0; j < n; ++j) count(j);
    } else {
      for (const int32_t j : s.candidates) count(j);
    }
    int64_t bucket = mask, last_filled = -1;
    double above = 0;
    for (; bucket >= 0; --bucket) {
      if (histogram[bucket] <= 0) continue;
      last_filled = bucket;
      if (above + histogram[bucket] >= target) break;
      above += histogram[bucket];
    }
    if (bucket < 0) {  // rounding: the weights fall short of target; take the lowest filled bucket
      bucket = last_filled;
      above -= histogram[bucket];
    }
    target -= above;
    prefix |= static_cast<uint32_t>(bucket) << shift;
    if (level == 2) break;
    s.next.clear();
    const auto keep = [&](int32_t j) {
      if (weight(j) > 0 && ((order_key(z[j]) >> shift) & mask) == static_cast<uint32_t>(bucket)) s.next.push_back(j);
    };
    if (level == 0) {
      for (int64_t j = 0; j < n; ++j) keep(static_cast<int32_t>(j));
    } else {
      for (const int32_t j : s.candidates) keep(j);
    }
    std::swap(s.candidates, s.next);
  }
  return from_key(prefix);
}

// The first j at which e[0..j]'s sum passes u * sum(e): one pass of block sums, one block walked.
int64_t draw(const float* e, int64_t n, double u, Scratch& s) {
  const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock;
  s.block_sums.resize(blocks);
  double* sums = s.block_sums.data();
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    float sum = 0;  // vectorised (-fassociative-math)
    for (int64_t j = b * kDrawBlock, end = std::min(n, j + kDrawBlock); j < end; ++j) sum += e[j];
    sums[b] = sum;
    total += sum;
  }
  const double target = u * total;
  double before = 0, through = 0;  // the sums of the blocks with mass ahead of `block`, and through it
  int64_t block = -1;
  for (int64_t b = 0; b < blocks; ++b) {
    if (sums[b] <= 0) continue;
    block = b;
    before = through;
    through += sums[b];
    if (through > target) break;
  }
  // Walk the block: the first whose sum passes target, else (rounding left target at or past the
  // total) the last with mass, where the walk ends on its last token with mass.
  int64_t last = -1;
  for (int64_t j = block * kDrawBlock, end = std::min(n, j + kDrawBlock); j < end; ++j) {
    if (e[j] <= 0) continue;
    last = j;
    before += e[j];
    if (before > target) return j;
  }
  return last;
}

// The z at which the candidates' e, summed from the largest z down, first reach `target`, or NaN
// where all of them together fall short (the nucleus reaches past them).
float select_among_candidates(const float* z, const float* e, double target, Scratch& s) {
  double mass = 0;
  for (const int32_t j : s.candidates) mass += e[j];
  if (mass < target) return std::numeric_limits<float>::quiet_NaN();
  std::sort(s.candidates.begin(), s.candidates.end(), [z](int32_t a, int32_t b) { return z[a] > z[b]; });
  double above = 0;
  for (const int32_t j : s.candidates) {
    above += e[j];
    if (above >= target) return z[j];
  }
  return z[s.candidates.back()];  // rounding: the sorted sum fell short of the unsorted one
}

int64_t sample_row(const float* logits, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                   double u, Scratch& s) {
  s.z.resize(n);
  s.e.resize(n);
  float* z = s.z.data();
  float* e = s.e.data();
  for (int64_t j = 0; j < n; ++j) z[j] = logits[j] / temperature;
  const float top = row_max(z, n);
  if (std::isnan(top)) return first_index(z, n, top);
  if (top == -std::numeric_limits<float>::infinity()) return 0;

  const bool by_k = top_k > 0 && top_k < n, by_p = top_p < 1;
  if (by_k || by_p) {
    s.block_max.resize((n + kBlock - 1) / kBlock);
    for (size_t b = 0; b < s.block_max.size(); ++b)
      s.block_max[b] = row_max(z + b * kBlock, std::min<int64_t>(kBlock, n - b * kBlock));
  }
  float threshold = std::numeric_limits<float>::lowest();  // finite z only
  if (by_k) {
    gather_candidates(z, n, top_k, threshold, s);
    // Fewer finite tokens than k: the k-th largest is -inf, which keeps them all.
    if (static_cast<int64_t>(s.candidates.size()) >= top_k) threshold = kth_largest(z, top_k, s);
  }
  const float after_top_k = threshold;
  for (int64_t j = 0; j < n; ++j) e[j] = z[j] >= after_top_k ? fast_exp(z[j] - top) : 0.0f;
  if (by_p) {
    double mass = 0;
    for (int64_t j = 0; j < n; ++j) mass += e[j];
    const double target = top_p * mass;
    // The kept tokens of top-k where it kept few, else the kTopPFirst most likely.
    if (!by_k || top_k > kTopPFirst) gather_candidates(z, n, kTopPFirst, after_top_k, s);
    float nucleus = select_among_candidates(z, e, target, s);
    if (std::isnan(nucleus)) nucleus = select_by_mass(z, e, n, target, s);
    threshold = std::max(threshold, nucleus);
  }
  if (min_p > 0) threshold = std::max(threshold, top + std::log(min_p));
  if (threshold > after_top_k)
    for (int64_t j = 0; j < n; ++j) e[j] = z[j] >= threshold ? e[j] : 0.0f;
  return draw(e, n, u, s);
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const std::optional<at::Tensor>& top_k,
                       const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                       const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "sample_rows: logits [M, V] with V > 0 expected");
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.stride(1) == 1, "sample_rows: float32 logits, contiguous rows");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "sample_rows: vocabularies below 2^31 tokens");
  const int64_t rows = logits.size(0), n = logits.size(1);
  const auto per_row = [rows](const std::optional<at::Tensor>& t, at::ScalarType dtype, const char* name) {
    if (!t.has_value()) return static_cast<const void*>(nullptr);
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == dtype && t->is_contiguous(),
                "sample_rows: ", name, " must be a contiguous [M] ", dtype, " tensor");
    return static_cast<const void*>(t->data_ptr());
  };
  const auto* temperatures = static_cast<const float*>(per_row(temperature, at::kFloat, "temperature"));
  const auto* ks = static_cast<const int64_t*>(per_row(top_k, at::kLong, "top_k"));
  const auto* ps = static_cast<const float*>(per_row(top_p, at::kFloat, "top_p"));
  const auto* min_ps = static_cast<const float*>(per_row(min_p, at::kFloat, "min_p"));
  const auto* us = static_cast<const double*>(per_row(uniforms, at::kDouble, "uniforms"));
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* base = logits.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  // A row is ~20-100 us: one task each, on the task pool (no OpenMP wake-up).
  for_each_range(rows, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t r = begin; r < end; ++r)
      tokens[r] = sample_row(base + r * stride, n, temperatures[r], ks ? ks[r] : 0, ps ? ps[r] : 1.0f,
                             min_ps ? min_ps[r] : 0.0f, us[r], scratch);
  });
  return out;
}

}  // namespace blockserve
