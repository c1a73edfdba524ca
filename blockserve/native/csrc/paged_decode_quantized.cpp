// Decode attention read in place from a quantized KV cache (attention/kv_quant.py's layout), and
// the fused decode step that writes it. Same contract as paged_decode.cpp's entry points, which
// call these for an int8 or float8_e4m3fn cache.
//
// A cache row is one head vector of one token: D one-byte codes (int8, or float8 e4m3), then its
// float16 scale (x = c * s); or (the rotated 4-bit form, a uint8 cache) D / 2 bytes of 4-bit codes,
// low nibble first, then its float16 scale and minimum (x = kInt4Levels[c] * s + m). The rotation is the
// caller's: it passes rotated queries (4-bit keys) and un-rotates the output (4-bit values). K and V
// may be stored in different forms: one-byte keys over 4-bit values (templates <FK, FV>, each side
// with its own row bytes). The SIMD paths widen e4m3 codes
// through float16: the code's sign, exponent and mantissa shifted into a float16's place stand for
// its value / 256 (subnormals too), and the 256 is folded into the scale.
// Scales are folded, never multiplied into the codes:
//     score_p = scale * (s_k[p] * (q . c_k[p]) + m_k[p] * sum(q))   (4-bit: c the codes' levels)
//     weight_p = softmax_p * s_v[p], and sum_p softmax_p * m_v[p] added to every output channel
// so a key costs one multiply (4-bit: two) beyond its codes' dot product, and all arithmetic is
// float32. Only slots of positions below seq_len are read. Three implementations of one (sequence,
// KV head): AVX-512 (16 keys at a time) and AVX2 (8) for head sizes 64, 128 and 256, a portable one
// else. The SIMD paths widen each chunk's 4-bit and e4m3 codes once into float32 scratch that all the
// KV head's query heads then read (kWidenOnce and to_lane_order say more).
// Writes quantise each head vector as kv_quant.encode does, to the same bytes: the 4-bit form after
// the same rotation (kv_quant.rotation: the seeded signs, then butterflies in the same order), 4-bit
// keys steered off the token's rotated queries and e4m3 keys off its queries (steer_codes; e4m3 keys
// also pick their scale by them, quantize_fp8_key), and the fused step rotates the queries itself
// (4-bit keys) and un-rotates its output (4-bit values).

#include "kernels.h"
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "fast_exp.h"
#include "lane_reduce.h"
#include "rotary.h"
#include "task_pool.h"

#if defined(__AVX512F__)
#define QUANTIZED_KV_AVX512 1
#else
#define QUANTIZED_KV_AVX512 0
#endif
#if !QUANTIZED_KV_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANTIZED_KV_AVX2 1
#else
#define QUANTIZED_KV_AVX2 0
#endif

namespace blockserve {
namespace {

constexpr int64_t kScaleBytes = 2;

// The stored forms: one-byte codes (int8, e4m3) with a scale, or packed 4-bit codes with a scale and a minimum.
enum Form { kInt8 = 0, kFp8 = 1, kInt4 = 2 };

// Bytes of a row's codes, and of the whole row.
template <int F>
constexpr int64_t code_bytes(int64_t dim) { return F == kInt4 ? dim / 2 : dim; }
template <int F>
constexpr int64_t row_bytes(int64_t dim) { return code_bytes<F>(dim) + (F == kInt4 ? 2 : 1) * kScaleBytes; }

inline float half_at(const int8_t* p) {
  at::Half value;
  std::memcpy(&value, p, kScaleBytes);
  return static_cast<float>(value);
}

template <int F>
inline float row_scale(const int8_t* row, int64_t dim) { return half_at(row + code_bytes<F>(dim)); }
// The row's minimum (the 4-bit form; 0 for the others).
template <int F>
inline float row_minimum(const int8_t* row, int64_t dim) {
  return F == kInt4 ? half_at(row + code_bytes<F>(dim) + kScaleBytes) : 0.f;
}

// The largest code magnitude: a row's largest |x| is stored as it.
template <bool FP8>
constexpr float kCodeMax = FP8 ? 448.f : 127.f;
// What the SIMD paths' widened codes are multiplied by to give the codes' values.
template <int F>
constexpr float kSimdUnit = F == kFp8 ? 256.f : 1.f;

// The 4-bit form's code values (kv_quant.INT4_LEVELS): code c stands for kInt4Levels[c] * s + m.
alignas(64) constexpr float kInt4Levels[16] = {0 / 64.f,   93 / 64.f,  168 / 64.f, 233 / 64.f, 292 / 64.f, 348 / 64.f,
                                               401 / 64.f, 454 / 64.f, 506 / 64.f, 559 / 64.f, 612 / 64.f, 668 / 64.f,
                                               727 / 64.f, 792 / 64.f, 867 / 64.f, 960 / 64.f};

// Code d of a row (4-bit: its level).
template <int F>
inline float code_value(const int8_t* row, int64_t d) {
  if constexpr (F == kInt4) {
    const uint8_t byte = static_cast<uint8_t>(row[d / 2]);
    return kInt4Levels[d % 2 ? byte >> 4 : byte & 15];
  } else if constexpr (F == kFp8) {
    const int8_t code = row[d];
    c10::Float8_e4m3fn value;
    std::memcpy(&value, &code, 1);
    return static_cast<float>(value);
  } else {
    return static_cast<float>(row[d]);
  }
}

// x / scale clamped to the codes' range (0 where the scale is 0): kv_quant._round_codes' ratio.
template <bool FP8>
inline float code_ratio(float x, float scale) {
  return scale > 0.f ? std::clamp(x / scale, -kCodeMax<FP8>, kCodeMax<FP8>) : 0.f;
}

// One head vector x [dim] into row [dim + 2]: kv_quant.encode's rounding (scale rounded to
// float16 first; codes: x / scale rounded half-even to int8 in [-127, 127], or to e4m3 in [-448, 448]).
template <bool FP8>
inline void quantize_row(const float* x, int8_t* row, int64_t dim) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const at::Half scale_half(std::min(amax / kCodeMax<FP8>, 65504.f));
  const float scale = static_cast<float>(scale_half);
  for (int64_t d = 0; d < dim; ++d) {
    const float ratio = code_ratio<FP8>(x[d], scale);
    if constexpr (FP8) {
      const c10::Float8_e4m3fn code(ratio);
      std::memcpy(row + d, &code, 1);
    } else {
      row[d] = static_cast<int8_t>(std::nearbyint(ratio));
    }
  }
  std::memcpy(row + dim, &scale_half, kScaleBytes);
}

// The rotated 4-bit form's rotation R = H diag(s) / sqrt(B) (attention/kv_quant.py): s the seeded sign
// per channel, H the Walsh-Hadamard transform over each block of B channels (B the largest power of
// two dividing dim). kv_quant draws the signs as torch.randint(0, 2) from a CPU generator seeded with
// ROTATION_SEED: torch's generator is the standard MT19937 seeded the standard way, and a draw below
// 2^32 is its next 32-bit output modulo the range, so std::mt19937 gives the same signs without a
// tensor (tests/attention/test_kv_quant.py compares the rows byte for byte).
constexpr uint32_t kRotationSeed = 0x5EED;  // kv_quant.ROTATION_SEED

std::vector<float> rotation_signs(int64_t dim) {
  std::mt19937 engine(kRotationSeed);
  std::vector<float> signs(dim);
  for (int64_t d = 0; d < dim; ++d) signs[d] = engine() % 2 ? 1.f : -1.f;  // kv_quant: randint(0, 2) * 2 - 1
  return signs;
}

// x [dim] in place as H x / sqrt(B) over each block of B channels, `work` [B] scratch. kv_quant._hadamard
// runs log2(B) stages of butterflies (a, b) -> (a + b, a - b) on channels h = 1, 2, 4, ... apart; here
// each stage takes adjacent pairs and writes sums to the first half, differences to the second
// (Pease's form: contiguous, so it vectorises), which combines the same partial sums in the same
// order, only stored permuted: after log2(B) stages the permutation is the identity again, and
// every value is the same float32 bits as kv_quant's.
void hadamard_(float* __restrict x, float* __restrict work, int64_t dim) {
  const int64_t block = dim & -dim, half = block / 2;
  const float norm = static_cast<float>(std::pow(static_cast<double>(block), -0.5));  // Python's block**-0.5
  for (float* first = x; first < x + dim; first += block) {
    float* from = first;
    float* to = work;
    for (int64_t h = 1; h < block; h *= 2) {
      for (int64_t i = 0; i < half; ++i) {
        const float a = from[2 * i], b = from[2 * i + 1];
        to[i] = a + b;
        to[half + i] = a - b;
      }
      std::swap(from, to);
    }
    for (int64_t d = 0; d < block; ++d) first[d] = from[d] * norm;
  }
}

// y = R x (kv_quant.rotate_queries), and x = R^T y in place (kv_quant.unrotate_output); `work` [dim].
void rotate(const float* x, float* y, const float* signs, int64_t dim, float* work) {
  for (int64_t d = 0; d < dim; ++d) y[d] = x[d] * signs[d];
  hadamard_(y, work, dim);
}
void unrotate_(float* y, const float* signs, int64_t dim, float* work) {
  hadamard_(y, work, dim);
  for (int64_t d = 0; d < dim; ++d) y[d] *= signs[d];
}

// kv_quant.STEER_MOVES and STEER_RIDGE.
constexpr int kSteerMoves = 4;
constexpr double kSteerRidge = 4.0;

// A code table for steer_codes: ascending float32 values, codes indexing them in [0, top].
struct Levels {
  const float* values;
  int top;
  // values[c + direction] - values[c] in float64 (kv_quant._steer_codes' up and down steps).
  double step(int c, int direction) const {
    return static_cast<double>(values[c + direction]) - static_cast<double>(values[c]);
  }
};

constexpr Levels kInt4Table{kInt4Levels, 15};

// kv_quant.FP8_ZERO: the index of 0 among the 253 finite e4m3 values in ascending order (fp8_levels).
constexpr int kFp8Zero = 126;

// kv_quant.fp8_levels: byte b of a positive value at kFp8Zero + b, of a negative one (0x80 | b) at kFp8Zero - b.
const Levels& fp8_table() {
  static const std::vector<float> values = [] {
    std::vector<float> out(2 * kFp8Zero + 1);
    for (int b = 0; b <= kFp8Zero; ++b) {
      c10::Float8_e4m3fn magnitude;
      const uint8_t byte = static_cast<uint8_t>(b);
      std::memcpy(&magnitude, &byte, 1);
      out[kFp8Zero + b] = static_cast<float>(magnitude);
      out[kFp8Zero - b] = -static_cast<float>(magnitude);
    }
    return out;
  }();
  static const Levels table{values.data(), 2 * kFp8Zero};
  return table;
}

// kv_quant._fp8_index and _fp8_bytes: an e4m3 code byte (never NaN) as its fp8_table index (-0 as 0), and back.
inline uint8_t fp8_index(uint8_t byte) {
  return static_cast<uint8_t>(byte & 0x80 ? kFp8Zero - (byte & 0x7F) : kFp8Zero + byte);
}
inline uint8_t fp8_byte(uint8_t index) {
  return static_cast<uint8_t>(index >= kFp8Zero ? index - kFp8Zero : 0x80 | (kFp8Zero - index));
}

// kv_quant._ridge: kSteerRidge times the mean squared value of a row's `group` queries q [group, dim],
// and each channel's sum of squares into weight [dim].
double steer_ridge(const float* q, int64_t group, int64_t dim, double* weight) {
  double total = 0.0;
  for (int64_t d = 0; d < dim; ++d) {
    double w = 0.0;
    for (int64_t j = 0; j < group; ++j) w += static_cast<double>(q[j * dim + d]) * q[j * dim + d];
    weight[d] = w;
    total += w;
  }
  return kSteerRidge * total / static_cast<double>(group * dim);
}

// kv_quant._steer_codes for one row: codes [dim] (indices into `levels`, y [dim]'s nearest,
// scale * levels[c] + minimum, scale > 0) after up to kSteerMoves single-code moves to a neighbouring
// level, each the move that lowers J = sum_j (q_j . e)^2 + ridge |e|^2 most,
// e = scale * levels[c] + minimum - y, q_j the row's `group` queries [group, dim]; float64, moves
// compared up then down, channel by channel, the first of equal ones taken. `work` [2 dim + group].
void steer_codes(uint8_t* codes, const float* y, float scale, float minimum, const float* q, int64_t group,
                 int64_t dim, const Levels& levels, double* work) {
  double* err = work;
  double* curvature = work + dim;
  double* along = work + 2 * dim;
  const double s = scale;
  const double ridge = steer_ridge(q, group, dim, curvature);
  for (int64_t d = 0; d < dim; ++d) {
    const double product = static_cast<double>(levels.values[codes[d]]) * s;  // exact in float64
    err[d] = product + static_cast<double>(minimum) - static_cast<double>(y[d]);
    curvature[d] += ridge;
  }
  for (int64_t j = 0; j < group; ++j) {
    double dot = 0.0;
    for (int64_t d = 0; d < dim; ++d) dot += static_cast<double>(q[j * dim + d]) * err[d];
    along[j] = dot;
  }
  for (int move = 0; move < kSteerMoves; ++move) {
    // one pass: each channel's slope once, its up (+1) and down (-1) moves each against the best of
    // their side; up wins a tie, as the first of kv_quant's concatenated (up, then down) gains
    double best_up = HUGE_VAL, best_down = HUGE_VAL;
    int64_t up_at = -1, down_at = -1;
    for (int64_t d = 0; d < dim; ++d) {
      double g = ridge * err[d];
      for (int64_t j = 0; j < group; ++j) g += static_cast<double>(q[j * dim + d]) * along[j];
      const double slope = 2.0 * g;
      if (codes[d] < levels.top) {  // the gain of moving e_d by delta: delta (curvature delta + slope)
        const double delta = levels.step(codes[d], 1) * s, gain = delta * (curvature[d] * delta + slope);
        if (gain < best_up) {
          best_up = gain;
          up_at = d;
        }
      }
      if (codes[d] > 0) {
        const double delta = levels.step(codes[d], -1) * s, gain = delta * (curvature[d] * delta + slope);
        if (gain < best_down) {
          best_down = gain;
          down_at = d;
        }
      }
    }
    const bool up = best_up <= best_down;
    const double best = up ? best_up : best_down;
    const int64_t at = up ? up_at : dim + down_at;
    if (!(best < 0.0)) break;
    const int64_t channel = at % dim;
    const int direction = at < dim ? 1 : -1;
    const double step = levels.step(codes[channel], direction) * s;
    codes[channel] = static_cast<uint8_t>(codes[channel] + direction);
    err[channel] += step;
    for (int64_t j = 0; j < group; ++j) along[j] += static_cast<double>(q[j * dim + channel]) * step;
  }
}

// kv_quant.FP8_SCALE_STEPS (2^(j/8) rounded to float32): an e4m3 key's candidate scales are max |x| / 448
// times these.
constexpr int kFp8ScaleSteps = 8;
const std::array<float, kFp8ScaleSteps>& fp8_scale_steps() {
  static const std::array<float, kFp8ScaleSteps> steps = [] {
    std::array<float, kFp8ScaleSteps> out{};
    for (int j = 0; j < kFp8ScaleSteps; ++j) out[j] = static_cast<float>(std::pow(2.0, j / 8.0));
    return out;
  }();
  return steps;
}

// The e4m3 value nearest r, |r| <= 448, ties to even: c10::Float8_e4m3fn's rounding, without the
// byte (below 2^-6 the step is 2^-9; above, a float32's mantissa rounded to 3 bits).
inline float round_to_e4m3(float r) {
  if (std::fabs(r) < 0.015625f) return std::nearbyint(r * 512.f) * (1.f / 512.f);
  uint32_t bits;
  std::memcpy(&bits, &r, 4);
  bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & 0xFFF00000u;
  std::memcpy(&r, &bits, 4);
  return r;
}

// A key x [dim] into an e4m3 row [dim + 2], steered off its `group` queries q [group, dim]:
// kv_quant._encode_fp8_keys (each candidate scale rounded to float16, x / scale rounded to e4m3 as
// quantize_row does; the candidate of least J in float64, the first of equal ones; then its codes
// steered over fp8_table). `index` [dim] bytes, `work` [2 dim + group] doubles.
void quantize_fp8_key(const float* x, int8_t* row, int64_t dim, const float* q, int64_t group, uint8_t* index,
                      double* work) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float base = amax / kCodeMax<true>;
  double* err = work;
  double* weight = work + dim;
  const double ridge = steer_ridge(q, group, dim, weight);
  double least = 0.0;
  at::Half best_scale;
  for (int j = 0; j < kFp8ScaleSteps; ++j) {
    const at::Half scale_half(std::min(base * fp8_scale_steps()[j], 65504.f));
    const float scale = static_cast<float>(scale_half);
    double squares = 0.0, dots = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      err[d] = static_cast<double>(round_to_e4m3(code_ratio<true>(x[d], scale))) * static_cast<double>(scale) -
               static_cast<double>(x[d]);
      squares += err[d] * err[d];
    }
    for (int64_t g = 0; g < group; ++g) {
      double dot = 0.0;
      for (int64_t d = 0; d < dim; ++d) dot += static_cast<double>(q[g * dim + d]) * err[d];
      dots += dot * dot;
    }
    const double objective = dots + ridge * squares;
    if (j == 0 || objective < least) {
      least = objective;
      best_scale = scale_half;
    }
  }
  const float scale = static_cast<float>(best_scale);
  for (int64_t d = 0; d < dim; ++d) {  // the chosen scale's codes, as fp8_table indices
    const c10::Float8_e4m3fn code(code_ratio<true>(x[d], scale));
    uint8_t byte;
    std::memcpy(&byte, &code, 1);
    index[d] = fp8_index(byte);
  }
  steer_codes(index, x, scale, 0.f, q, group, dim, fp8_table(), work);
  for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<int8_t>(fp8_byte(index[d]));
  std::memcpy(row + dim, &best_scale, kScaleBytes);
}

// One rotated head vector y [dim] into a 4-bit row [dim / 2 + 4]: kv_quant._encode_int4's rounding
// (minimum and scale rounded to float16 first; code of (y - minimum) / scale: how many of the levels'
// float32 midpoints lie below it, two a byte, low nibble first; all 0 where the scale is not
// positive), then, for a key
// with its `group` rotated queries q [group, dim] (none: q null), steered off them (steer_codes).
// `work` [dim] bytes and [2 dim + group] doubles.
inline void quantize_row_int4(const float* y, int8_t* row, int64_t dim, const float* q, int64_t group,
                              uint8_t* codes, double* work) {
  float low = y[0], high = y[0];
  for (int64_t d = 1; d < dim; ++d) {
    low = std::min(low, y[d]);
    high = std::max(high, y[d]);
  }
  const at::Half minimum_half(std::clamp(low, -65504.f, 65504.f));
  const float minimum = static_cast<float>(minimum_half);
  const at::Half scale_half(std::min((high - minimum) / 15.f, 65504.f));
  const float scale = static_cast<float>(scale_half);
  for (int64_t d = 0; d < dim; ++d) {
    const float ratio = scale > 0.f ? (y[d] - minimum) / scale : 0.f;
    uint8_t code = 0;
    for (int c = 0; c < 15; ++c) code += ratio > (kInt4Levels[c] + kInt4Levels[c + 1]) * 0.5f;
    codes[d] = code;
  }
  if (q != nullptr && scale > 0.f) steer_codes(codes, y, scale, minimum, q, group, dim, kInt4Table, work);
  for (int64_t d = 0; d < dim; d += 2) row[d / 2] = static_cast<int8_t>(codes[d] | (codes[d + 1] << 4));
  std::memcpy(row + dim / 2, &scale_half, kScaleBytes);
  std::memcpy(row + dim / 2 + kScaleBytes, &minimum_half, kScaleBytes);
}

// Scratch for write_row: the rotated vector and the rotation's work [2 dim], and the code and steering
// scratch of quantize_row_int4 and quantize_fp8_key.
struct RowScratch {
  RowScratch(int64_t dim, int64_t group) : rotated(2 * dim), codes(dim), work(2 * dim + group) {}
  std::vector<float> rotated;
  std::vector<uint8_t> codes;
  std::vector<double> work;
};

// One head vector x [dim] into a row of `form`: the 4-bit form rotated first; a 4-bit key steered off
// its `group` rotated queries q, an e4m3 key off its queries q (null for values).
inline void write_row(int form, const float* x, int8_t* row, int64_t dim, const float* signs, RowScratch& scratch,
                      const float* q = nullptr, int64_t group = 0) {
  if (form == kInt4) {
    float* y = scratch.rotated.data();
    rotate(x, y, signs, dim, y + dim);
    quantize_row_int4(y, row, dim, q, group, scratch.codes.data(), scratch.work.data());
  } else if (form == kFp8 && q != nullptr) {
    quantize_fp8_key(x, row, dim, q, group, scratch.codes.data(), scratch.work.data());
  } else if (form == kFp8) {
    quantize_row<true>(x, row, dim);
  } else {
    quantize_row<false>(x, row, dim);
  }
}

// Requests the rows [lo, hi) of the next block (K and V, the item's head) ahead of their use.
template <int FK, int FV>
inline void prefetch_rows(const int8_t* next_k, const int8_t* next_v, int64_t lo, int64_t hi, int64_t k_stride,
                          int64_t v_stride, int64_t dim) {
  if (next_k == nullptr) return;
  for (int64_t j = lo; j < hi; ++j) {
    for (int64_t byte = 0; byte < row_bytes<FK>(dim); byte += 64) __builtin_prefetch(next_k + j * k_stride + byte);
    for (int64_t byte = 0; byte < row_bytes<FV>(dim); byte += 64) __builtin_prefetch(next_v + j * v_stride + byte);
  }
}

// The arguments of one (sequence, KV head) item: its `group` query heads against the K/V rows of
// its positions [start, stop), into the online-softmax state (acc, run_max, run_sum), which the
// caller starts at 0, -FLT_MAX and 0 and normalises afterwards.
struct Item {
  const float* q;           // [group, dim]
  const int8_t* k;          // the cache's first row of this KV head (slot 0)
  const int8_t* v;
  const int64_t* table;     // the sequence's block table row
  int64_t start, stop, group, dim, block_size, k_stride, v_stride;  // bytes between slots of K, of V
  float scale;
  const float* qsum;        // [group]: each query head's sum (the 4-bit form's minimum times it)
  float* acc;               // [group, dim]
  float* weights;           // [group, lanes], 64-byte aligned
  float* correction;        // [group]
  float* bias;              // [group]: a chunk's sum_j w_j * m_v[j] (the 4-bit form)
  float* run_max;
  float* run_sum;
  float* q_lanes;           // [group, dim]: the SIMD paths' queries in lane order (4-bit keys)
  float* rows;              // [lanes, dim], 64-byte aligned: the SIMD paths' widened rows of a chunk
};

// Where the block holding `base` starts, and the next block (null where the sequence ends first).
inline void block_of(const Item& it, int64_t base, const int8_t** k, const int8_t** v, const int8_t** next_k,
                     const int8_t** next_v) {
  const int64_t block = it.table[base / it.block_size];
  *k = it.k + block * it.block_size * it.k_stride;
  *v = it.v + block * it.block_size * it.v_stride;
  *next_k = *next_v = nullptr;
  if (base + it.block_size < it.stop) {
    const int64_t next = it.table[base / it.block_size + 1];
    *next_k = it.k + next * it.block_size * it.k_stride;
    *next_v = it.v + next * it.block_size * it.v_stride;
  }
}

template <int FK, int FV>
void attend_portable(const Item& it) {
  const int64_t dim = it.dim;
  for (int64_t base = it.start - it.start % it.block_size; base < it.stop; base += it.block_size) {
    const int8_t *kb, *vb, *nk, *nv;
    block_of(it, base, &kb, &vb, &nk, &nv);
    const int64_t lo = std::max(it.start, base) - base, hi = std::min(it.stop, base + it.block_size) - base;
    for (int64_t j = lo; j < hi; ++j) {
      const int8_t* kr = kb + j * it.k_stride;
      const int8_t* vr = vb + j * it.v_stride;
      const float ks = row_scale<FK>(kr, dim) * it.scale, vs = row_scale<FV>(vr, dim);
      const float km = row_minimum<FK>(kr, dim) * it.scale, vm = row_minimum<FV>(vr, dim);
      for (int64_t hq = 0; hq < it.group; ++hq) {
        const float* qh = it.q + hq * dim;
        float dot = 0.f;
        for (int64_t d = 0; d < dim; ++d) dot += qh[d] * code_value<FK>(kr, d);
        const float score = dot * ks + km * it.qsum[hq];
        const float new_max = std::max(it.run_max[hq], score);
        const float fix = fast_exp(it.run_max[hq] - new_max), w = fast_exp(score - new_max);
        it.run_max[hq] = new_max;
        it.run_sum[hq] = it.run_sum[hq] * fix + w;
        float* ah = it.acc + hq * dim;
        const float wv = w * vs, wm = w * vm;
        for (int64_t d = 0; d < dim; ++d) ah[d] = ah[d] * fix + (wv * code_value<FV>(vr, d) + wm);
      }
    }
  }
}

// The SIMD paths widen a chunk's 4-bit and e4m3 K rows once, then its V rows, into float32 scratch
// that every query head of the item reads: a KV head's query heads share its rows, so each code is
// widened once, not once per query head. int8 codes are read straight from the cache instead: one
// sign-extending load and one conversion cost less than a store and a reload. A 4-bit row's bytes widen without an interleaving shuffle: L bytes give L low
// nibbles (even channels), then L high nibbles (odd channels), so each block of 2L channels is held
// as its L even channels, then its L odd ones ("lane order"). Queries over 4-bit keys are put in
// lane order once per item, and an accumulator over 4-bit values is put back once at its end.
template <int F>
constexpr bool kWidenOnce = F != kInt8;

template <int L>
void to_lane_order(const float* x, float* y, int64_t dim) {
  for (int64_t b = 0; b < dim; b += 2 * L)
    for (int p = 0; p < L; ++p) {
      y[b + p] = x[b + 2 * p];
      y[b + L + p] = x[b + 2 * p + 1];
    }
}
template <int L>
void from_lane_order(const float* y, float* x, int64_t dim) {
  for (int64_t b = 0; b < dim; b += 2 * L)
    for (int p = 0; p < L; ++p) {
      x[b + 2 * p] = y[b + p];
      x[b + 2 * p + 1] = y[b + L + p];
    }
}

// The float16 scales (and 4-bit minima) of a chunk's rows [0, n) of L, `stride` bytes apart; 0 past n.
template <int F, int L>
inline void chunk_scales(const int8_t* rows, int64_t stride, int64_t n, int64_t dim, uint16_t* scale,
                         uint16_t* minimum) {
  for (int64_t j = 0; j < L; ++j) {
    scale[j] = minimum[j] = 0;
    if (j >= n) continue;
    std::memcpy(scale + j, rows + j * stride + code_bytes<F>(dim), kScaleBytes);
    if constexpr (F == kInt4) std::memcpy(minimum + j, rows + j * stride + code_bytes<F>(dim) + kScaleBytes, kScaleBytes);
  }
}

// The item's queries as the SIMD paths' K scratch holds channels (lane order over 4-bit keys): it.q, or
// it.q_lanes filled.
template <int FK, int L>
const float* queries_in_lane_order(const Item& it) {
  if constexpr (FK != kInt4) return it.q;
  for (int64_t hq = 0; hq < it.group; ++hq) to_lane_order<L>(it.q + hq * it.dim, it.q_lanes + hq * it.dim, it.dim);
  return it.q_lanes;
}

// The accumulators back in channel order (over 4-bit values), through the row scratch.
template <int FV, int L>
void accumulators_in_channel_order(const Item& it) {
  if constexpr (FV == kInt4)
    for (int64_t hq = 0; hq < it.group; ++hq) {
      std::copy(it.acc + hq * it.dim, it.acc + (hq + 1) * it.dim, it.rows);
      from_lane_order<L>(it.rows, it.acc + hq * it.dim, it.dim);
    }
}

#if QUANTIZED_KV_AVX512
// A chunk's 4-bit or e4m3 rows [0, n), `stride` bytes apart, widened to float32 into out [n, 16 C]
// (e4m3: / 256; 4-bit: each code's level, looked up in a register, in lane order). e4m3 widens through float16: the code sign-extended and shifted left by 7
// puts its exponent and mantissa in a float16's place (value / 256, subnormals too) and its sign on
// bits 15 and 14; clearing bit 14 leaves the float16.
template <int F, int C>
inline void widen_rows16(const int8_t* first, int64_t stride, int64_t n, float* __restrict out) {
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* row = first + j * stride;
    float* o = out + j * 16 * C;
    if constexpr (F == kInt4) {
      const __m128i nibble = _mm_set1_epi8(15);
      const __m512 levels = _mm512_load_ps(kInt4Levels);
      for (int g = 0; g < C / 2; ++g) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g));
        const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
        _mm512_store_ps(o + 32 * g, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, nibble)), levels));
        _mm512_store_ps(o + 32 * g + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(high), levels));
      }
    } else {
      for (int c = 0; c < C; ++c) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c));
        const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                              _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
        _mm512_store_ps(o + 16 * c, _mm512_cvtph_ps(half));
      }
    }
  }
}

// Codes 16 c.. of row j of a chunk as float32: from the scratch widen_rows16 filled, or (int8) from
// the row at first + j * stride.
template <int F, int C>
inline __m512 chunk_codes16(const float* rows, const int8_t* first, int64_t stride, int64_t j, int c) {
  if constexpr (kWidenOnce<F>) return _mm512_load_ps(rows + j * 16 * C + 16 * c);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(first + j * stride + 16 * c));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

inline __m512 halves16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
}

// Head size 16 * C, keys 16 at a time: the chunk's K rows widened once, then per query head its 16
// scores in one vector and the online softmax on it; the V rows widened once, then every head's
// V-scaled weights into its accumulator.
template <int FK, int FV, int C>
void attend_avx512(const Item& it) {
  constexpr int64_t dim = 16 * C;
  const int64_t ks_stride = it.k_stride, vs_stride = it.v_stride;
  const float* queries = queries_in_lane_order<FK, 16>(it);
  float* __restrict rows = it.rows;
  alignas(32) uint16_t kscale[16], kmin[16], vscale[16], vmin[16];
  const __m512 k_unit = _mm512_set1_ps(it.scale * kSimdUnit<FK>), k_min_unit = _mm512_set1_ps(it.scale);
  const __m512 v_unit = _mm512_set1_ps(kSimdUnit<FV>);
  for (int64_t base = it.start - it.start % it.block_size; base < it.stop; base += it.block_size) {
    const int8_t *kb, *vb, *nk, *nv;
    block_of(it, base, &kb, &vb, &nk, &nv);
    const int64_t hi = std::min(it.stop, base + it.block_size) - base;
    for (int64_t lo = std::max(it.start, base) - base; lo < hi; lo += 16) {
      const int64_t n = std::min<int64_t>(16, hi - lo);
      prefetch_rows<FK, FV>(nk, nv, lo, std::min(lo + 16, it.block_size), ks_stride, vs_stride, dim);
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      const int8_t* kh = kb + lo * ks_stride;
      const int8_t* vh = vb + lo * vs_stride;
      chunk_scales<FK, 16>(kh, ks_stride, n, dim, kscale, kmin);
      chunk_scales<FV, 16>(vh, vs_stride, n, dim, vscale, vmin);
      const __m512 ks = _mm512_mul_ps(halves16(kscale), k_unit), km = _mm512_mul_ps(halves16(kmin), k_min_unit);
      const __m512 vs = _mm512_mul_ps(halves16(vscale), v_unit), vm = halves16(vmin);
      if constexpr (kWidenOnce<FK>) widen_rows16<FK, C>(kh, ks_stride, n, rows);
      for (int64_t hq = 0; hq < it.group; ++hq) {
        __m512 q[C], part[16];
        for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(queries + hq * dim + 16 * c);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          part[j] = _mm512_setzero_ps();
          if (j < n)
            for (int c = 0; c < C; ++c) part[j] = _mm512_fmadd_ps(q[c], chunk_codes16<FK, C>(rows, kh, ks_stride, j, c), part[j]);
        }
        __m512 score = _mm512_mul_ps(lanes_transpose_sum16(part), ks);
        if constexpr (FK == kInt4) score = _mm512_fmadd_ps(km, _mm512_set1_ps(it.qsum[hq]), score);
        _mm512_store_ps(it.weights + 16 * hq, score);
      }
      for (int64_t hq = 0; hq < it.group; ++hq) {
        const __m512 score = _mm512_load_ps(it.weights + 16 * hq);
        const float chunk_max = std::max(it.run_max[hq], _mm512_mask_reduce_max_ps(valid, score));
        const __m512 w = _mm512_maskz_mov_ps(valid, fast_exp16(_mm512_sub_ps(score, _mm512_set1_ps(chunk_max))));
        it.correction[hq] = fast_exp(it.run_max[hq] - chunk_max);
        it.run_max[hq] = chunk_max;
        it.run_sum[hq] = it.run_sum[hq] * it.correction[hq] + _mm512_reduce_add_ps(w);
        if constexpr (FV == kInt4) it.bias[hq] = _mm512_reduce_add_ps(_mm512_mul_ps(w, vm));
        _mm512_store_ps(it.weights + 16 * hq, _mm512_mul_ps(w, vs));
      }
      if constexpr (kWidenOnce<FV>) widen_rows16<FV, C>(vh, vs_stride, n, rows);
      for (int64_t hq = 0; hq < it.group; ++hq) {  // even and odd keys in two chains
        const float* wh = it.weights + 16 * hq;
        float* ah = it.acc + hq * dim;
        __m512 even[C], odd[C];
        const __m512 bias = _mm512_set1_ps(FV == kInt4 ? it.bias[hq] : 0.f);
        for (int c = 0; c < C; ++c) {
          even[c] = _mm512_fmadd_ps(_mm512_loadu_ps(ah + 16 * c), _mm512_set1_ps(it.correction[hq]), bias);
          odd[c] = _mm512_setzero_ps();
        }
        int64_t j = 0;
        for (; j + 1 < n; j += 2) {
          const __m512 we = _mm512_set1_ps(wh[j]), wo = _mm512_set1_ps(wh[j + 1]);
          for (int c = 0; c < C; ++c) {
            even[c] = _mm512_fmadd_ps(we, chunk_codes16<FV, C>(rows, vh, vs_stride, j, c), even[c]);
            odd[c] = _mm512_fmadd_ps(wo, chunk_codes16<FV, C>(rows, vh, vs_stride, j + 1, c), odd[c]);
          }
        }
        if (j < n) {
          const __m512 we = _mm512_set1_ps(wh[j]);
          for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(we, chunk_codes16<FV, C>(rows, vh, vs_stride, j, c), even[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(ah + 16 * c, _mm512_add_ps(even[c], odd[c]));
      }
    }
  }
  accumulators_in_channel_order<FV, 16>(it);
}
#endif

#if QUANTIZED_KV_AVX2
// The levels of 8 codes [0, 16): each looked up in both halves of the table, the half picked by the
// code's bit 3 (shifted into the sign bit blendv reads).
inline __m256 levels8(__m256i codes, __m256 low_levels, __m256 high_levels) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_levels, codes), _mm256_permutevar8x32_ps(high_levels, codes),
                          _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
}

// widen_rows16's contract on 8 lanes, head size 8 * C.
template <int F, int C>
inline void widen_rows8(const int8_t* first, int64_t stride, int64_t n, float* __restrict out) {
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* row = first + j * stride;
    float* o = out + j * 8 * C;
    if constexpr (F == kInt4) {
      const __m128i nibble = _mm_set1_epi8(15);
      const __m256 low_levels = _mm256_load_ps(kInt4Levels), high_levels = _mm256_load_ps(kInt4Levels + 8);
      for (int g = 0; g < C / 2; ++g) {
        const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * g));
        const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
        _mm256_store_ps(o + 16 * g, levels8(_mm256_cvtepu8_epi32(_mm_and_si128(packed, nibble)), low_levels, high_levels));
        _mm256_store_ps(o + 16 * g + 8, levels8(_mm256_cvtepu8_epi32(high), low_levels, high_levels));
      }
    } else {
      for (int c = 0; c < C; ++c) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c));
        const __m128i half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                                           _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
        _mm256_store_ps(o + 8 * c, _mm256_cvtph_ps(half));
      }
    }
  }
}

// chunk_codes16's contract on 8 lanes.
template <int F, int C>
inline __m256 chunk_codes8(const float* rows, const int8_t* first, int64_t stride, int64_t j, int c) {
  if constexpr (kWidenOnce<F>) return _mm256_load_ps(rows + j * 8 * C + 8 * c);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(first + j * stride + 8 * c));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

inline __m256 halves8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(p))); }

// attend_avx512's contract on 8 lanes, head size 8 * C; the V rows go into the accumulator
// SLICE registers at a time.
template <int FK, int FV, int C>
void attend_avx2(const Item& it) {
  constexpr int64_t dim = 8 * C;
  constexpr int SLICE = C < 8 ? C : 8;
  const int64_t ks_stride = it.k_stride, vs_stride = it.v_stride;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const float* queries = queries_in_lane_order<FK, 8>(it);
  float* __restrict rows = it.rows;
  alignas(16) uint16_t kscale[8], kmin[8], vscale[8], vmin[8];
  const __m256 k_unit = _mm256_set1_ps(it.scale * kSimdUnit<FK>), k_min_unit = _mm256_set1_ps(it.scale);
  const __m256 v_unit = _mm256_set1_ps(kSimdUnit<FV>);
  for (int64_t base = it.start - it.start % it.block_size; base < it.stop; base += it.block_size) {
    const int8_t *kb, *vb, *nk, *nv;
    block_of(it, base, &kb, &vb, &nk, &nv);
    const int64_t hi = std::min(it.stop, base + it.block_size) - base;
    for (int64_t lo = std::max(it.start, base) - base; lo < hi; lo += 8) {
      const int64_t n = std::min<int64_t>(8, hi - lo);
      prefetch_rows<FK, FV>(nk, nv, lo, std::min(lo + 8, it.block_size), ks_stride, vs_stride, dim);
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
      const int8_t* kh = kb + lo * ks_stride;
      const int8_t* vh = vb + lo * vs_stride;
      chunk_scales<FK, 8>(kh, ks_stride, n, dim, kscale, kmin);
      chunk_scales<FV, 8>(vh, vs_stride, n, dim, vscale, vmin);
      const __m256 ks = _mm256_mul_ps(halves8(kscale), k_unit), km = _mm256_mul_ps(halves8(kmin), k_min_unit);
      const __m256 vs = _mm256_mul_ps(halves8(vscale), v_unit), vm = halves8(vmin);
      if constexpr (kWidenOnce<FK>) widen_rows8<FK, C>(kh, ks_stride, n, rows);
      for (int64_t hq = 0; hq < it.group; ++hq) {
        const float* qh = queries + hq * dim;
        __m256 part[8];
        for (int j = 0; j < 8; ++j) part[j] = _mm256_setzero_ps();
        for (int c = 0; c < C; ++c) {
          const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j)
            if (j < n) part[j] = _mm256_fmadd_ps(qc, chunk_codes8<FK, C>(rows, kh, ks_stride, j, c), part[j]);
        }
        __m256 score = _mm256_mul_ps(lanes_transpose_sum8(part), ks);
        if constexpr (FK == kInt4) score = _mm256_fmadd_ps(km, _mm256_set1_ps(it.qsum[hq]), score);
        _mm256_store_ps(it.weights + 8 * hq, score);
      }
      for (int64_t hq = 0; hq < it.group; ++hq) {
        const __m256 score = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), _mm256_load_ps(it.weights + 8 * hq), valid);
        const float chunk_max = std::max(it.run_max[hq], lanes_max8(score));
        const __m256 w = _mm256_and_ps(valid, fast_exp8(_mm256_sub_ps(score, _mm256_set1_ps(chunk_max))));
        it.correction[hq] = fast_exp(it.run_max[hq] - chunk_max);
        it.run_max[hq] = chunk_max;
        it.run_sum[hq] = it.run_sum[hq] * it.correction[hq] + lanes_add8(w);
        if constexpr (FV == kInt4) it.bias[hq] = lanes_add8(_mm256_mul_ps(w, vm));
        _mm256_store_ps(it.weights + 8 * hq, _mm256_mul_ps(w, vs));
      }
      if constexpr (kWidenOnce<FV>) widen_rows8<FV, C>(vh, vs_stride, n, rows);
      for (int64_t hq = 0; hq < it.group; ++hq) {
        const float* wh = it.weights + 8 * hq;
        const __m256 fix = _mm256_set1_ps(it.correction[hq]), bias = _mm256_set1_ps(FV == kInt4 ? it.bias[hq] : 0.f);
        for (int s = 0; s < C; s += SLICE) {
          float* ah = it.acc + hq * dim + 8 * s;
          __m256 sum[SLICE];
          for (int c = 0; c < SLICE; ++c) sum[c] = _mm256_fmadd_ps(_mm256_loadu_ps(ah + 8 * c), fix, bias);
          for (int64_t j = 0; j < n; ++j) {
            const __m256 wj = _mm256_set1_ps(wh[j]);
            for (int c = 0; c < SLICE; ++c) sum[c] = _mm256_fmadd_ps(wj, chunk_codes8<FV, C>(rows, vh, vs_stride, j, s + c), sum[c]);
          }
          for (int c = 0; c < SLICE; ++c) _mm256_storeu_ps(ah + 8 * c, sum[c]);
        }
      }
    }
  }
  accumulators_in_channel_order<FV, 8>(it);
}
#endif

using Path = void (*)(const Item&);

template <int FK, int FV>
Path path_for(int64_t dim) {
#if QUANTIZED_KV_AVX512
  if (dim == 64) return attend_avx512<FK, FV, 4>;
  if (dim == 128) return attend_avx512<FK, FV, 8>;
  if (dim == 256) return attend_avx512<FK, FV, 16>;
#elif QUANTIZED_KV_AVX2
  if (dim == 64) return attend_avx2<FK, FV, 8>;
  if (dim == 128) return attend_avx2<FK, FV, 16>;
  if (dim == 256) return attend_avx2<FK, FV, 32>;
#endif
  return attend_portable<FK, FV>;
}

// The path for keys of form `fk` and values of form `fv`: one form for both, or one-byte keys over
// 4-bit values (check_quantized_cache refuses the rest).
Path path_for_forms(int fk, int fv, int64_t dim) {
  if (fv == kInt4 && fk != kInt4) return fk == kFp8 ? path_for<kFp8, kInt4>(dim) : path_for<kInt8, kInt4>(dim);
  if (fk == kInt4) return path_for<kInt4, kInt4>(dim);
  return fk == kFp8 ? path_for<kFp8, kFp8>(dim) : path_for<kInt8, kInt8>(dim);
}

// The stored form of a cache, its head size and its row bytes.
int form_of(const at::Tensor& cache) {
  if (cache.scalar_type() == at::kByte) return kInt4;
  return cache.scalar_type() == at::kFloat8_e4m3fn ? kFp8 : kInt8;
}
int64_t head_size_of(const at::Tensor& cache) {
  return form_of(cache) == kInt4 ? 2 * (cache.size(3) - 2 * kScaleBytes) : cache.size(3) - kScaleBytes;
}

// Every sequence's decode; sequence n's query heads are the n_heads * dim floats at qp + n * q_stride.
// Work items and their split as paged_decode.cpp's decode_all: one per (sequence, KV head), on the
// task pool up to pool_sequences() sequences, on OpenMP beyond.
void decode_all(at::Tensor out, const float* qp, int64_t q_stride, int64_t n_seqs, int64_t n_heads,
                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                const at::Tensor& key_start, const at::Tensor& seq_lens, float scale) {
  const int64_t n_kv_heads = k_cache.size(2), dim = head_size_of(k_cache), block_size = k_cache.size(1);
  const int64_t group = n_heads / n_kv_heads, width = block_table.size(1);
  const int64_t k_row = k_cache.size(3), v_row = v_cache.size(3);
  const int8_t* kp = static_cast<const int8_t*>(k_cache.data_ptr());
  const int8_t* vp = static_cast<const int8_t*>(v_cache.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* starts = key_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const bool rotated_keys = form_of(k_cache) == kInt4;
  const Path attend = path_for_forms(form_of(k_cache), form_of(v_cache), dim);
  int64_t keys = 0;
  for (int64_t n = 0; n < n_seqs; ++n) keys += lens[n] - starts[n];
  const int64_t items = n_seqs * n_kv_heads;
  const int64_t per_item = std::max<int64_t>(1, keys * group * dim / std::max<int64_t>(1, n_seqs));
  const auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * dim), run_max(group), run_sum(group), correction(group), bias(group), qsum(group);
    std::vector<float> weights_buffer(group * 16 + 16), rows_buffer(16 * dim + 16), q_lanes(group * dim);
    const auto aligned = [](std::vector<float>& buffer) {
      return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    };
    float* weights = aligned(weights_buffer);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / n_kv_heads, kv = item % n_kv_heads;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -FLT_MAX);
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      const float* q = qp + n * q_stride + kv * group * dim;
      if (rotated_keys)
        for (int64_t hq = 0; hq < group; ++hq) qsum[hq] = std::accumulate(q + hq * dim, q + (hq + 1) * dim, 0.f);
      const Item it{q, kp + kv * k_row, vp + kv * v_row, table + n * width, starts[n], lens[n], group, dim,
                    block_size, n_kv_heads * k_row, n_kv_heads * v_row, scale, qsum.data(), acc.data(), weights,
                    correction.data(), bias.data(), run_max.data(), run_sum.data(), q_lanes.data(),
                    aligned(rows_buffer)};
      attend(it);
      float* on = op + n * n_heads * dim + kv * group * dim;
      for (int64_t hq = 0; hq < group; ++hq) {
        const float inv = run_sum[hq] > 0.f ? 1.f / run_sum[hq] : 0.f;
        for (int64_t d = 0; d < dim; ++d) on[hq * dim + d] = acc[hq * dim + d] * inv;
      }
    }
  };
  if (n_seqs <= pool_sequences()) {
    blockserve::for_each_range(items, std::max<int64_t>(1, (int64_t{1} << 17) / per_item), body);
  } else {
    at::parallel_for(0, items, std::max<int64_t>(1, (int64_t{1} << 20) / per_item), body);
  }
}

void check_quantized_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                      const at::Tensor& key_start, const at::Tensor& seq_lens, int64_t n_seqs, int64_t n_heads,
                      int64_t dim, const char* name) {
  const auto one_byte = [](const at::Tensor& t) {
    return t.scalar_type() == at::kChar || t.scalar_type() == at::kFloat8_e4m3fn;
  };
  TORCH_CHECK((one_byte(k_cache) || k_cache.scalar_type() == at::kByte) &&
                  (v_cache.scalar_type() == k_cache.scalar_type() ||
                   (one_byte(k_cache) && v_cache.scalar_type() == at::kByte)),
              name, ": int8, float8_e4m3fn or uint8 (4-bit) K and V caches of one dtype, or int8 / float8_e4m3fn "
              "keys over uint8 (4-bit) values, expected");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3) &&
                  head_size_of(k_cache) == dim && head_size_of(v_cache) == dim,
              name, ": K and V caches [blocks, block_size, Hkv, D + 2] (codes, float16 scale) or [..., D / 2 + 4] "
              "(4-bit codes, float16 scale and minimum) expected");
  TORCH_CHECK(block_table.dtype() == at::kLong && key_start.dtype() == at::kLong && seq_lens.dtype() == at::kLong,
              name, ": int64 block_table, key_start and seq_lens expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous() &&
                  key_start.is_contiguous() && seq_lens.is_contiguous(),
              name, ": contiguous tensors expected");
  TORCH_CHECK(block_table.size(0) >= n_seqs && key_start.numel() >= n_seqs && seq_lens.numel() >= n_seqs,
              name, ": a block table row, key_start and seq_len per sequence expected");
  TORCH_CHECK(n_heads % k_cache.size(2) == 0, name, ": query heads must be a multiple of KV heads");
}

}  // namespace

void paged_decode_attention_quantized(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                 at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens, double scale) {
  const char* name = "paged_decode_attention (quantized cache)";
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat, name, ": float32 q and out expected");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(), name,
              ": contiguous q and out [N, Hq, D] expected");
  check_quantized_cache(k_cache, v_cache, block_table, key_start, seq_lens, q.size(0), q.size(1), q.size(2), name);
  decode_all(out, q.data_ptr<float>(), q.size(1) * q.size(2), q.size(0), q.size(1), k_cache, v_cache, block_table,
             key_start, seq_lens, static_cast<float>(scale));
}

void rotary_decode_attention_quantized(at::Tensor out, at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                                  at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                                  at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens,
                                  int64_t n_heads, double scale) {
  const char* name = "rotary_decode_attention (quantized cache)";
  TORCH_CHECK(qkv.dtype() == at::kFloat && out.dtype() == at::kFloat && cos.dtype() == at::kFloat &&
                  sin.dtype() == at::kFloat,
              name, ": float32 qkv, cos, sin and out expected");
  TORCH_CHECK(k_cache.dim() == 4, name, ": K and V caches [blocks, block_size, Hkv, row] expected");
  const int64_t n_seqs = qkv.size(0), n_kv_heads = k_cache.size(2), dim = head_size_of(k_cache);
  check_quantized_cache(k_cache, v_cache, block_table, key_start, seq_lens, n_seqs, n_heads, dim, name);
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
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), k_row = k_cache.size(3), v_row = v_cache.size(3);
  for (int64_t n = 0; n < n_seqs; ++n)
    TORCH_CHECK(slots[n] >= 0 && slots[n] < num_slots, name, ": slot ", slots[n], " outside the cache (", num_slots,
                " slots)");
  int8_t* kc = static_cast<int8_t*>(k_cache.data_ptr());
  int8_t* vc = static_cast<int8_t*>(v_cache.data_ptr());
  const int fk = form_of(k_cache), fv = form_of(v_cache);
  // 4-bit keys hold R k, so the queries attend as R q (into their own buffer: qkv keeps q as rotary
  // left it); 4-bit values give R o, un-rotated once below.
  const bool rotated_keys = fk == kInt4, rotated_values = fv == kInt4;
  const std::vector<float> signs = rotated_keys || rotated_values ? rotation_signs(dim) : std::vector<float>();
  // 4-bit keys are steered off the token's rotated queries (kv_quant.encode), so those come first;
  // e4m3 keys off its queries as they are.
  const int64_t group = n_heads / n_kv_heads;
  RowScratch scratch(dim, group);
  std::vector<float> rotated_q(rotated_keys ? n_seqs * q_size : 0);
  for (int64_t n = 0; n < n_seqs; ++n) {  // a few KB per sequence: not worth a parallel region
    float* x = qkvp + n * qkv.stride(0);
    rotate_half_heads(x, n_heads + n_kv_heads, dim, cos.data_ptr<float>() + n * cos.stride(0),
                      sin.data_ptr<float>() + n * sin.stride(0));
    float* q = rotated_keys ? rotated_q.data() + n * q_size : nullptr;
    if (rotated_keys)
      for (int64_t h = 0; h < n_heads; ++h) rotate(x + h * dim, q + h * dim, signs.data(), dim, scratch.rotated.data());
    for (int64_t h = 0; h < n_kv_heads; ++h) {
      const float* key_queries = rotated_keys ? q + h * group * dim : fk == kFp8 ? x + h * group * dim : nullptr;
      write_row(fk, x + q_size + h * dim, kc + (slots[n] * n_kv_heads + h) * k_row, dim, signs.data(), scratch,
                key_queries, group);
      write_row(fv, x + q_size + kv_size + h * dim, vc + (slots[n] * n_kv_heads + h) * v_row, dim, signs.data(),
                scratch);
    }
  }
  if (rotated_keys)
    decode_all(out, rotated_q.data(), q_size, n_seqs, n_heads, k_cache, v_cache, block_table, key_start, seq_lens,
               static_cast<float>(scale));
  else
    decode_all(out, qkvp, qkv.stride(0), n_seqs, n_heads, k_cache, v_cache, block_table, key_start, seq_lens,
               static_cast<float>(scale));
  if (rotated_values) {
    float* op = out.data_ptr<float>();
    for (int64_t head = 0; head < n_seqs * n_heads; ++head)
      unrotate_(op + head * dim, signs.data(), dim, scratch.rotated.data());
  }
}

}  // namespace blockserve
