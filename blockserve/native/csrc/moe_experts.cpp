// Routed SwiGLU experts of a mixture-of-experts layer in one call (models/moe.py, Experts):
//
//   out[t] = Σ_j weights[t, j] · down_e(silu(gate_e x[t]) * up_e x[t]),  e = ids[t, j]
//
//   moe_experts(x, weights, ids, gate_up [E, 2I, H], down [E, H, I])      float32 experts
//   moe_experts_blocks(x, weights, ids, gate, gate_format, up, up_format,  experts in GGUF blocks,
//                      down, down_format, intermediate, activations)       [E, rows, row bytes] each
//   moe_experts_mxfp4(x, weights, ids, gate_up_blocks, gate_up_scales,     GPT-OSS's experts in MXFP4
//                     gate_up_bias, down_blocks, down_scales, down_bias,   (below)
//                     alpha, limit)
//   moe_experts_gpt_oss(x, weights, ids, gate_up [E, H, 2I], gate_up_bias,  GPT-OSS's float32 experts,
//                       down [E, I, H], down_bias, alpha, limit)            input-major (its checkpoint's)
//   moe_experts_blocks_gpt_oss(x, weights, ids, gate, gate_format, up,     GPT-OSS's experts in GGUF blocks
//                              up_format, down, down_format, gate_up_bias,  (Q8_0, K-quants, ...: what
//                              down_bias, alpha, limit, activations)        llama-quantize writes for some mixes)
//
// The (token, slot) pairs are grouped by expert with a counting sort (experts in id order, a
// token's pairs in token order), each expert's tokens gathered once. float32 experts: those with
// at most kMaxRows tokens (every expert of a decode step) run as one task-pool job over all their
// weight rows at once (gate|up rows, then the down rows: two jobs a layer, each weight row read
// once and dotted with its expert's few tokens, the vector code the compiler's at the build's
// width); an expert with more tokens (prefill) takes torch's GEMM. GGUF experts: each expert's
// projections through gguf_blocks.cpp's gguf_matmul_decode at every token count (up to 8 tokens,
// a decode step's, x as integer limbs and the int8 kernel's integer dots; more, four weight rows
// dequantised at a time into a cache-resident buffer and multiplied in register tiles), read from
// the file's blocks: measured at gpt-oss-20b's shape in Q8_0 at one thread, it beats float32 GEMM
// over the same values at 1 to 256 tokens on AVX-512 and up to ~32 on AVX2 (0.84-0.88x at 64-128),
// where dequantising the expert whole for torch's GEMM, or GEMM over L2-sized dequantised panels,
// did not (docs/cpu.md). SiLU(gate) * up is fused into one
// pass, and the weighted sum is added per token in expert-id order (the order the Python loop sums
// in).
//
// GGUF experts' activations (the engine's --quantized-activations): float32 as above; int16 rounds x
// and each pair's h per block of 32 (block_levels.h) and runs the float32 path on them; int8 rounds
// each token's x once (once per weight layout: gate and up share it where their formats' layouts
// agree) and each pair's h once, and runs gguf_blocks_int8.cpp's integer dots (gguf_blocks_int8.h)
// over every picked expert's gate and up rows as one task-pool job, then over their down rows as
// another: every output is the bits gguf_matmul_int8 gives for that expert's rows, at every token count.
//
// GPT-OSS (models/gpt_oss.py): the checkpoint's MXFP4 blocks [E, N, K/32, 16] and scales [E, N, K/32]
// (mxfp4.cpp's layout), gate_up's rows interleaved (gate at even rows, up at odd), a bias after each
// projection and the clamped SwiGLU between them:
//
//   gate = min(gu[2i] + b[2i], limit)   up = clamp(gu[2i+1] + b[2i+1], ±limit)
//   h[i] = (up + 1) · gate · sigmoid(alpha · gate)          y = down(h) + b_down
//
// Experts with fewer than kMxfp4GemmRows tokens run as one task-pool job over all their weight rows
// (each row dequantised once into a per-task buffer, mxfp4_row.h, and dotted with its expert's
// tokens); an expert with more takes mxfp4_matmul (its tiled GEMM). Float32 experts, stored
// input-major, take one addmm per expert picked (torch's GEMM reads [K, N] rows as they lie).
// GPT-OSS's experts in GGUF blocks (llama.cpp's ffn_gate_exps / ffn_up_exps [E, I, row bytes] apart,
// ffn_down_exps [E, H, row bytes]) run as moe_experts_blocks does, each expert's rows through
// gguf_matmul_decode, with the checkpoint's interleaved gate_up bias and the clamped
// SwiGLU above between the projections.

#include "kernels.h"

#include "block_levels.h"
#include "gguf_blocks_int8.h"
#include "mxfp4_row.h"
#include "row_dot.h"
#include "task_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace blockserve {
namespace {

constexpr int64_t kMaxRows = 8;  // an expert with more tokens than this takes the GEMM
constexpr int64_t kInt8TaskRows = 64;  // the fewest weight rows an int8 experts task takes (4 row blocks)
constexpr int64_t kMxfp4GemmRows = 16;  // an MXFP4 expert with this many tokens takes mxfp4_matmul's GEMM

struct Groups {
  std::vector<int64_t> start;   // [E + 1]: expert e's pairs are order[start[e] .. start[e + 1])
  std::vector<int64_t> token;   // [T * k] the pair's token, grouped by expert
  std::vector<float> weight;    // [T * k] the pair's routing weight
};

Groups group_by_expert(const at::Tensor& weights, const at::Tensor& ids, int64_t experts) {
  const int64_t T = ids.size(0), k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  Groups g{std::vector<int64_t>(experts + 1, 0), std::vector<int64_t>(T * k), std::vector<float>(T * k)};
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < experts, "moe_experts: expert id ", id[p], " out of range [0, ", experts, ")");
    ++g.start[id[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t at = fill[id[p]]++;
    g.token[at] = p / k;
    g.weight[at] = w[p];
  }
  return g;
}

void check_inputs(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "moe_experts: x must be contiguous float32 [T, H]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == x.size(0) && ids.is_contiguous(),
              "moe_experts: ids must be contiguous int64 [T, k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes() && weights.is_contiguous(),
              "moe_experts: weights must be contiguous float32 [T, k], as ids");
}

// h [n, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void silu_mul(const float* gate_up, int64_t n, int64_t I, float* h) {
  for (int64_t r = 0; r < n; ++r) {
    const float* g = gate_up + r * 2 * I;
    const float* u = g + I;
    float* o = h + r * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

// out[m * stride] = w · x[m] for the M rows of x (length K)
inline void dot_tokens(const float* w, const float* x, int64_t M, int64_t K, float* out, int64_t stride) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += w[k] * xm[k];
    out[m * stride] = s;
  }
}

// For each expert in `small`: out_e [n_e, N] = in_e [n_e, K] @ W_e^T, W_e = weight + e * N * K. One
// job over the experts' N rows each; in_e / out_e at the offsets `first` (rows of in / out).
void small_experts_matmul(const std::vector<int64_t>& small, const std::vector<int64_t>& count,
                          const std::vector<int64_t>& first, const float* weight, int64_t N, int64_t K,
                          const float* in, float* out) {
  const int64_t rows = static_cast<int64_t>(small.size()) * N;
  for_each_range(rows, std::max<int64_t>(1, (1 << 15) / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t s = r / N, n = r % N, e = small[s];
      dot_tokens(weight + (e * N + n) * K, in + first[s] * K, count[s], K, out + first[s] * N + n, N);
    }
  });
}

// out[token] += weight · y for each pair, experts in id order
void add_weighted(const Groups& g, const float* y, int64_t H, float* out) {
  for (size_t p = 0; p < g.token.size(); ++p) {
    float* o = out + g.token[p] * H;
    const float* yp = y + p * H;
    const float w = g.weight[p];
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) o[h] += w * yp[h];
  }
}

// x's rows [T, C] (contiguous) of the pairs' tokens, grouped by expert: copied on this thread (ATen's
// gather of a decode step's rows opens an OpenMP region, whose spinning threads then hold the cores
// the task pool's jobs that follow need)
at::Tensor gathered(const at::Tensor& x, const Groups& g) {
  const int64_t pairs = static_cast<int64_t>(g.token.size()), row = x.size(1) * x.element_size();
  auto out = at::empty({pairs, x.size(1)}, x.options());
  const auto* from = static_cast<const uint8_t*>(x.data_ptr());
  auto* to = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t p = 0; p < pairs; ++p) std::memcpy(to + p * row, from + g.token[p] * row, row);
  return out;
}

void check_biases(const at::Tensor& gate_up_bias, const at::Tensor& down_bias, int64_t E, int64_t I, int64_t H) {
  TORCH_CHECK(gate_up_bias.scalar_type() == at::kFloat && gate_up_bias.is_contiguous() &&
                  gate_up_bias.sizes() == at::IntArrayRef({E, 2 * I}),
              "GPT-OSS experts: gate_up_bias must be contiguous float32 [E, 2I]");
  TORCH_CHECK(down_bias.scalar_type() == at::kFloat && down_bias.is_contiguous() &&
                  down_bias.sizes() == at::IntArrayRef({E, H}),
              "GPT-OSS experts: down_bias must be contiguous float32 [E, H]");
}

// h [pairs, I] of gu [pairs, 2I] (biases added; gate at even columns, up at odd): GPT-OSS's clamped SwiGLU
at::Tensor clamped_swiglu(const at::Tensor& gu, double alpha, double limit) {
  const int64_t pairs = gu.size(0), I = gu.size(1) / 2;
  auto h = at::empty({pairs, I}, gu.options());
  const float* gup = gu.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  for (int64_t p = 0; p < pairs; ++p) {
    const float* r = gup + p * 2 * I;
    float* o = hp + p * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      const float gate = std::min(r[2 * i], l), up = std::clamp(r[2 * i + 1], -l, l);
      o[i] = (up + 1.f) * gate / (1.f + std::exp(-a * gate));
    }
  }
  return h;
}

// out [pairs, N] = each pair's row of in [pairs, K] times its expert's float32 weight [E, K, N]
// (input-major, as GPT-OSS's checkpoint stores it) plus its bias [E, N]: one addmm per expert picked
void input_major_experts_matmul(const Groups& g, const at::Tensor& in, const at::Tensor& weight,
                                const at::Tensor& bias, at::Tensor& out) {
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(g.start.size()); ++e) {
    const int64_t n = g.start[e + 1] - g.start[e];
    if (n == 0) continue;
    auto rows = out.narrow(0, g.start[e], n);
    at::addmm_out(rows, bias[e], in.narrow(0, g.start[e], n), weight[e]);
  }
}

// One projection of every expert in MXFP4: blocks [E, N, K/32, 16], scales [E, N, K/32].
struct Mxfp4Experts {
  const uint8_t* blocks;
  const uint8_t* scales;
  int64_t N, K;
};

Mxfp4Experts mxfp4_experts(const at::Tensor& blocks, const at::Tensor& scales, int64_t E, int64_t K,
                           const char* name) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 4 && blocks.is_contiguous() &&
                  blocks.size(0) == E && blocks.size(2) * mxfp4::kBlock == K && blocks.size(3) == mxfp4::kBlock / 2,
              "moe_experts_mxfp4: ", name, "_blocks must be contiguous uint8 [E, N, ", K, "/32, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.dim() == 3 && scales.is_contiguous() &&
                  scales.sizes() == blocks.sizes().slice(0, 3),
              "moe_experts_mxfp4: ", name, "_scales must be contiguous uint8 [E, N, K/32], as its blocks");
  return {blocks.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), blocks.size(1), K};
}

// For each expert in `small`: out_e [n_e, N] = in_e [n_e, K] @ W_e^T, in_e's columns as
// mxfp4::split_even_odd orders them. One job over the experts' N rows each.
void small_mxfp4_experts_matmul(const std::vector<int64_t>& small, const std::vector<int64_t>& count,
                                const std::vector<int64_t>& first, const Mxfp4Experts& w, const float* in,
                                float* out) {
  const int64_t groups = w.K / mxfp4::kBlock, rows = static_cast<int64_t>(small.size()) * w.N;
  for_each_range(rows, std::max<int64_t>(1, (1 << 15) / w.K), [&](int64_t begin, int64_t end) {
    std::vector<float> row(w.K);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t s = r / w.N, n = r % w.N, at = small[s] * w.N + n;
      mxfp4::dequantize_row(w.blocks + at * groups * (mxfp4::kBlock / 2), w.scales + at * groups, groups, row.data());
      dot_rows(row.data(), in + first[s] * w.K, count[s], w.K, out + first[s] * w.N + n, w.N);
    }
  });
}

// out [pairs, N] = each pair's row of in [pairs, K] through its expert's MXFP4 projection, plus its bias [E, N]
void mxfp4_experts_matmul(const Groups& g, const at::Tensor& in, const at::Tensor& blocks, const at::Tensor& scales,
                          const Mxfp4Experts& w, const float* bias, at::Tensor& out) {
  const int64_t E = static_cast<int64_t>(g.start.size()) - 1;
  std::vector<int64_t> small, count, first;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = g.start[e + 1] - g.start[e];
    if (n == 0) continue;
    if (n < kMxfp4GemmRows) {
      small.push_back(e), count.push_back(n), first.push_back(g.start[e]);
      continue;
    }
    out.narrow(0, g.start[e], n).copy_(mxfp4_matmul(in.narrow(0, g.start[e], n), blocks[e], scales[e]));
  }
  if (!small.empty())
    small_mxfp4_experts_matmul(small, count, first, w, mxfp4::split_even_odd(in).data_ptr<float>(),
                               out.data_ptr<float>());
  float* o = out.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t p = g.start[e]; p < g.start[e + 1]; ++p) {
      float* row = o + p * w.N;
      const float* b = bias + e * w.N;
#pragma omp simd
      for (int64_t n = 0; n < w.N; ++n) row[n] += b[n];
    }
}

void check_blocks_experts(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, int64_t E,
                          int64_t I, int64_t H, const char* name) {
  for (const auto* t : {&gate, &up, &down})
    TORCH_CHECK(t->scalar_type() == at::kByte && t->dim() == 3 && t->size(0) == E && t->is_contiguous(),
                name, ": gate, up and down must be contiguous uint8 [E, rows, row bytes]");
  TORCH_CHECK(gate.size(1) == I && up.size(1) == I && down.size(1) == H,
              name, ": gate and up need `intermediate` rows, down H rows");
}

enum class Activations { kFloat32, kInt8, kInt16 };

Activations activations_named(const std::string& name, const char* what) {
  if (name == "float32") return Activations::kFloat32;
  if (name == "int8") return Activations::kInt8;
  if (name == "int16") return Activations::kInt16;
  TORCH_CHECK(false, what, ": activations must be float32, int8 or int16, not ", name);
}

// x [M, K] rounded per block of 32 to int16 levels, back in float32 (quantized_linear.round_per_block(x, 32767))
at::Tensor rounded16(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "moe_experts: int16 activations need rows of whole 32-value blocks, not ", K);
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_range(M, std::max<int64_t>(1, 4096 / K), [&](int64_t begin, int64_t end) {
    std::vector<int16_t> r(K);
    std::vector<float> s(K / 32), sum(K / 32);
    for (int64_t m = begin; m < end; ++m) {
      quantize_blocks(xp + m * K, K / 32, r.data(), s.data(), sum.data());
      for (int64_t k = 0; k < K; ++k) op[m * K + k] = static_cast<float>(r[k]) * s[k / 32];
    }
  });
  return out;
}

// A SwiGLU MoE layer's experts in GGUF blocks: gate, up [E, I, row bytes] and down [E, H, row bytes].
struct BlockExperts {
  const at::Tensor& gate;
  const std::string& gate_format;
  const at::Tensor& up;
  const std::string& up_format;
  const at::Tensor& down;
  const std::string& down_format;
  int64_t E, I, H;
  Activations activations;
};

// One projection of every expert for the int8 path: expert e's N rows of K values at w + e * N * row_bytes,
// dotted with its pairs' rows of x (arranged for `kernel`, x_bytes apart) into out [pairs, N].
struct Int8Projection {
  GgufInt8Kernel kernel;
  const uint8_t* w;
  int64_t row_bytes, N, K;
  const uint8_t* x;
  int64_t x_bytes;
  float* out;
};

Int8Projection int8_projection(const at::Tensor& raw, const std::string& format, int64_t K, const char* name) {
  const GgufInt8Kernel kernel = gguf_int8_kernel(format);
  TORCH_CHECK(K % kernel.elems == 0 && raw.size(2) == K / kernel.elems * kernel.bytes, "moe_experts_blocks: ", name,
              ": ", format, " rows of ", K, " values take ", K / kernel.elems * kernel.bytes, " bytes, not ",
              raw.size(2));
  return {kernel, raw.data_ptr<uint8_t>(), raw.size(2), raw.size(1), K, nullptr, 0, nullptr};
}

// For every projection and expert with pairs: its N rows dotted with its pairs' rows of x, as one job
// over all those weight rows (each read once per call); tasks of at least ~64 K multiply-adds and of
// whole blocks of the kernel's row tiles (an expert with more than 4 tokens unpacks 16 weight rows at
// a time into a per-call buffer: smaller tasks would unpack partial blocks and set up more buffers).
void int8_experts_dot(const Groups& g, const std::vector<Int8Projection>& projections) {
  struct Segment {
    const Int8Projection* p;
    int64_t expert, first, count, offset;  // rows [offset, offset + N) of the job
  };
  std::vector<Segment> segments;
  int64_t total = 0, macs = 0;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(g.start.size()); ++e) {
    const int64_t n = g.start[e + 1] - g.start[e];
    if (n == 0) continue;
    for (const auto& p : projections) {
      segments.push_back({&p, e, g.start[e], n, total});
      total += p.N;
      macs += p.N * p.K * n;
    }
  }
  if (total == 0) return;
  const int64_t min_rows = std::max<int64_t>(kInt8TaskRows, (int64_t{1} << 16) * total / macs);
  for_each_range(total, min_rows, [&](int64_t begin, int64_t end) {
    auto s = std::upper_bound(segments.begin(), segments.end(), begin,
                              [](int64_t row, const Segment& seg) { return row < seg.offset; }) - 1;
    for (; s != segments.end() && s->offset < end; ++s) {
      const Int8Projection& p = *s->p;
      const int64_t from = std::max(begin, s->offset) - s->offset, to = std::min(end, s->offset + p.N) - s->offset;
      p.kernel.dot(p.w + s->expert * p.N * p.row_bytes, p.row_bytes, p.K, from, to, p.x + s->first * p.x_bytes,
                   s->count, p.N, p.out + s->first * p.N);
    }
  });
}

// y [pairs, H] of the int8 path: x rounded once per token for gate and up (once per layout), h once per pair.
template <typename Act>
at::Tensor int8_experts(const at::Tensor& x, const Groups& g, const BlockExperts& ex, const Act& act) {
  const int64_t pairs = static_cast<int64_t>(g.token.size());
  Int8Projection gate = int8_projection(ex.gate, ex.gate_format, ex.H, "gate");
  Int8Projection up = int8_projection(ex.up, ex.up_format, ex.H, "up");
  Int8Projection down = int8_projection(ex.down, ex.down_format, ex.I, "down");
  const at::Tensor xg = gathered(gate.kernel.arrange(x), g);
  const at::Tensor xu = up.kernel.layout == gate.kernel.layout ? xg : gathered(up.kernel.arrange(x), g);
  auto gate_out = at::empty({pairs, ex.I}, x.options());
  auto up_out = at::empty({pairs, ex.I}, x.options());
  gate.x = xg.data_ptr<uint8_t>(), gate.x_bytes = xg.size(1), gate.out = gate_out.data_ptr<float>();
  up.x = xu.data_ptr<uint8_t>(), up.x_bytes = xu.size(1), up.out = up_out.data_ptr<float>();
  int8_experts_dot(g, {gate, up});
  std::vector<int64_t> expert(pairs);
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(g.start.size()); ++e)
    std::fill(expert.begin() + g.start[e], expert.begin() + g.start[e + 1], e);
  float* gp = gate_out.data_ptr<float>();
  const float* upp = up_out.data_ptr<float>();
  for_each_range(pairs, std::max<int64_t>(1, 8192 / ex.I), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) act(expert[p], gp + p * ex.I, upp + p * ex.I, ex.I);
  });
  const at::Tensor h = down.kernel.arrange(gate_out);
  auto y = at::empty({pairs, ex.H}, x.options());
  down.x = h.data_ptr<uint8_t>(), down.x_bytes = h.size(1), down.out = y.data_ptr<float>();
  int8_experts_dot(g, {down});
  return y;
}

// y [pairs, H] of the float32 path (int16: x and h rounded per block first), each expert through gguf_matmul_decode.
template <typename Act>
at::Tensor float_experts(const at::Tensor& x, const Groups& g, const BlockExperts& ex, const Act& act) {
  const int64_t pairs = static_cast<int64_t>(g.token.size());
  const bool int16 = ex.activations == Activations::kInt16;
  const at::Tensor xs = gathered(int16 ? rounded16(x) : x, g);
  auto y = at::empty({pairs, ex.H}, x.options());
  for (int64_t e = 0; e < ex.E; ++e) {
    const int64_t n = g.start[e + 1] - g.start[e];
    if (n == 0) continue;
    const auto xe = xs.narrow(0, g.start[e], n);
    auto gate_e = gguf_matmul_decode(xe, ex.gate[e], ex.gate_format);  // [n, I], made here: contiguous
    const auto up_e = gguf_matmul_decode(xe, ex.up[e], ex.up_format);
    float* gp = gate_e.data_ptr<float>();
    const float* upp = up_e.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) act(e, gp + r * ex.I, upp + r * ex.I, ex.I);
    y.narrow(0, g.start[e], n).copy_(gguf_matmul_decode(int16 ? rounded16(gate_e) : gate_e, ex.down[e], ex.down_format));
  }
  return y;
}

// out [T, H] = each token's routed experts (Act: a pair's h from its gate and up rows, in place of gate),
// down's bias [E, H] added where given, weighted and summed per token in expert-id order.
template <typename Act>
at::Tensor blocks_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                          const BlockExperts& ex, const float* down_bias, const Act& act) {
  auto out = at::zeros_like(x);
  const Groups g = group_by_expert(weights, ids, ex.E);
  if (g.token.empty()) return out;
  at::Tensor y = ex.activations == Activations::kInt8 ? int8_experts(x, g, ex, act) : float_experts(x, g, ex, act);
  if (down_bias != nullptr)
    for (int64_t e = 0; e < ex.E; ++e)
      for (int64_t p = g.start[e]; p < g.start[e + 1]; ++p) {
        float* row = y.data_ptr<float>() + p * ex.H;
        const float* b = down_bias + e * ex.H;
#pragma omp simd
        for (int64_t h = 0; h < ex.H; ++h) row[h] += b[h];
      }
  add_weighted(g, y.data_ptr<float>(), ex.H, out.data_ptr<float>());
  return out;
}

}  // namespace

at::Tensor moe_experts(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate_up, at::Tensor down) {
  check_inputs(x, weights, ids);
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 3 && gate_up.is_contiguous() &&
                  gate_up.size(2) == x.size(1) && gate_up.size(1) % 2 == 0,
              "moe_experts: gate_up must be contiguous float32 [E, 2I, H]");
  const int64_t E = gate_up.size(0), H = x.size(1), I = gate_up.size(1) / 2;
  TORCH_CHECK(down.scalar_type() == at::kFloat && down.is_contiguous() && down.dim() == 3 && down.size(0) == E &&
                  down.size(1) == H && down.size(2) == I,
              "moe_experts: down must be contiguous float32 [E, H, I]");
  auto out = at::zeros_like(x);
  const Groups g = group_by_expert(weights, ids, E);
  const int64_t pairs = static_cast<int64_t>(g.token.size());
  if (pairs == 0) return out;
  const auto xs = gathered(x, g);  // [pairs, H], grouped by expert
  auto gu = at::empty({pairs, 2 * I}, x.options());
  auto h = at::empty({pairs, I}, x.options());
  auto y = at::empty({pairs, H}, x.options());
  std::vector<int64_t> small, count, first;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = g.start[e + 1] - g.start[e];
    if (n == 0) continue;
    if (n <= kMaxRows) {
      small.push_back(e), count.push_back(n), first.push_back(g.start[e]);
      continue;
    }
    const auto rows = [&](const at::Tensor& t) { return t.narrow(0, g.start[e], n); };
    auto gu_e = rows(gu);
    at::mm_out(gu_e, rows(xs), gate_up[e].t());
    silu_mul(gu_e.data_ptr<float>(), n, I, rows(h).data_ptr<float>());
    auto y_e = rows(y);
    at::mm_out(y_e, rows(h), down[e].t());
  }
  if (!small.empty()) {
    small_experts_matmul(small, count, first, gate_up.data_ptr<float>(), 2 * I, H, xs.data_ptr<float>(),
                         gu.data_ptr<float>());
    for (size_t s = 0; s < small.size(); ++s)
      silu_mul(gu.data_ptr<float>() + first[s] * 2 * I, count[s], I, h.data_ptr<float>() + first[s] * I);
    small_experts_matmul(small, count, first, down.data_ptr<float>(), H, I, h.data_ptr<float>(),
                         y.data_ptr<float>());
  }
  add_weighted(g, y.data_ptr<float>(), H, out.data_ptr<float>());
  return out;
}

at::Tensor moe_experts_blocks(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate,
                              const std::string& gate_format, at::Tensor up, const std::string& up_format,
                              at::Tensor down, const std::string& down_format, int64_t intermediate,
                              const std::string& activations) {
  check_inputs(x, weights, ids);
  const int64_t E = gate.size(0), H = x.size(1), I = intermediate;
  check_blocks_experts(gate, up, down, E, I, H, "moe_experts_blocks");
  const BlockExperts experts{gate, gate_format, up, up_format, down, down_format, E, I, H,
                             activations_named(activations, "moe_experts_blocks")};
  return blocks_experts(x, weights, ids, experts, nullptr, [](int64_t, float* gate, const float* up, int64_t n) {
    for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  });
}

at::Tensor moe_experts_mxfp4(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate_up_blocks,
                             at::Tensor gate_up_scales, at::Tensor gate_up_bias, at::Tensor down_blocks,
                             at::Tensor down_scales, at::Tensor down_bias, double alpha, double limit) {
  check_inputs(x, weights, ids);
  const int64_t E = gate_up_blocks.size(0), H = x.size(1);
  const Mxfp4Experts gate_up = mxfp4_experts(gate_up_blocks, gate_up_scales, E, H, "gate_up");
  TORCH_CHECK(gate_up.N % 2 == 0 && (gate_up.N / 2) % mxfp4::kBlock == 0,
              "moe_experts_mxfp4: gate_up needs 2I rows, I a multiple of 32");
  const int64_t I = gate_up.N / 2;
  const Mxfp4Experts down = mxfp4_experts(down_blocks, down_scales, E, I, "down");
  TORCH_CHECK(down.N == H, "moe_experts_mxfp4: down must have H = ", H, " rows");
  check_biases(gate_up_bias, down_bias, E, I, H);
  auto out = at::zeros_like(x);
  const Groups g = group_by_expert(weights, ids, E);
  const int64_t pairs = static_cast<int64_t>(g.token.size());
  if (pairs == 0) return out;
  auto gu = at::empty({pairs, 2 * I}, x.options());
  mxfp4_experts_matmul(g, gathered(x, g), gate_up_blocks, gate_up_scales, gate_up, gate_up_bias.data_ptr<float>(), gu);
  const auto h = clamped_swiglu(gu, alpha, limit);
  auto y = at::empty({pairs, H}, x.options());
  mxfp4_experts_matmul(g, h, down_blocks, down_scales, down, down_bias.data_ptr<float>(), y);
  add_weighted(g, y.data_ptr<float>(), H, out.data_ptr<float>());
  return out;
}

at::Tensor moe_experts_gpt_oss(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate_up,
                               at::Tensor gate_up_bias, at::Tensor down, at::Tensor down_bias, double alpha,
                               double limit) {
  check_inputs(x, weights, ids);
  const int64_t E = gate_up.size(0), H = x.size(1);
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 3 && gate_up.is_contiguous() &&
                  gate_up.size(1) == H && gate_up.size(2) % 2 == 0,
              "moe_experts_gpt_oss: gate_up must be contiguous float32 [E, H, 2I]");
  const int64_t I = gate_up.size(2) / 2;
  TORCH_CHECK(down.scalar_type() == at::kFloat && down.is_contiguous() &&
                  down.sizes() == at::IntArrayRef({E, I, H}),
              "moe_experts_gpt_oss: down must be contiguous float32 [E, I, H]");
  check_biases(gate_up_bias, down_bias, E, I, H);
  auto out = at::zeros_like(x);
  const Groups g = group_by_expert(weights, ids, E);
  const int64_t pairs = static_cast<int64_t>(g.token.size());
  if (pairs == 0) return out;
  auto gu = at::empty({pairs, 2 * I}, x.options());
  input_major_experts_matmul(g, gathered(x, g), gate_up, gate_up_bias, gu);
  auto y = at::empty({pairs, H}, x.options());
  input_major_experts_matmul(g, clamped_swiglu(gu, alpha, limit), down, down_bias, y);
  add_weighted(g, y.data_ptr<float>(), H, out.data_ptr<float>());
  return out;
}

at::Tensor moe_experts_blocks_gpt_oss(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate,
                                      const std::string& gate_format, at::Tensor up, const std::string& up_format,
                                      at::Tensor down, const std::string& down_format, at::Tensor gate_up_bias,
                                      at::Tensor down_bias, double alpha, double limit,
                                      const std::string& activations) {
  check_inputs(x, weights, ids);
  const int64_t E = gate.size(0), H = x.size(1), I = gate.size(1);
  check_blocks_experts(gate, up, down, E, I, H, "moe_experts_blocks_gpt_oss");
  check_biases(gate_up_bias, down_bias, E, I, H);
  const BlockExperts experts{gate, gate_format, up, up_format, down, down_format, E, I, H,
                             activations_named(activations, "moe_experts_blocks_gpt_oss")};
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  const float* biases = gate_up_bias.data_ptr<float>();
  return blocks_experts(x, weights, ids, experts, down_bias.data_ptr<float>(),
                        [&](int64_t e, float* gate, const float* up, int64_t n) {
                          const float* bias = biases + e * 2 * I;  // gate at even entries, up at odd
                          for (int64_t i = 0; i < n; ++i) {
                            const float gv = std::min(gate[i] + bias[2 * i], l);
                            const float uv = std::clamp(up[i] + bias[2 * i + 1], -l, l);
                            gate[i] = (uv + 1.f) * gv / (1.f + std::exp(-a * gv));
                          }
                        });
}

}  // namespace blockserve
