// GGUF block formats read in place, in the file's own byte layout ([rows, row bytes], no
// repacking): the 5-bit formats (Q5_0, Q5_1), the K-quants (Q2_K .. Q6_K: super-blocks of 256
// with packed sub-block scales), the non-linear 4-bit ones (IQ4_NL, IQ4_XS), and Q4_0 / Q4_1 /
// Q8_0 for the weights quantized_matmul.cpp's packed layout does not take (a fused projection
// whose parts differ in format, an embedding).
//
//   gguf_dequantize(raw, format, columns)  -> float32 [rows, columns]: the values gguf-py's
//       dequantize gives, bit for bit (every product below is exact in float32 or rounded once,
//       in gguf-py's order); for embedding rows and for the tiles a many-row matmul multiplies.
//   gguf_matmul(x, raw, format)            -> out [M, N] = x [M, K] @ W^T, W [N, K] in `raw`:
//       up to kFusedMaxRows rows of x (8 on AVX-512, 2 on AVX2: decode), four weight rows' blocks
//       are unpacked side by side, 16 values at a time dequantised in registers and multiplied
//       with up to 4 (AVX-512) or 2 (AVX2) rows of x into register accumulators as they come, so
//       no weight is written to memory; more rows: four weight rows at a time are dequantised
//       into a per-task buffer of 4 x 1024 floats (L1) and multiplied with the M rows of x in
//       register tiles (4 weight rows x 4 rows of x on AVX-512, 2 x 6 on AVX2, each vector of the
//       tile's weights and rows loaded once per step), each weight dequantised once per call
//       whatever M is, the next group's blocks prefetched meanwhile. Both read the weights at their
//       file size, take K in panels of whole blocks (fixed, so x's panel stays in L2 across a task's
//       weight rows at many rows), each panel's sums added to the last's, and give the same bits.
//   gguf_matmul_decode(x, raw, format)     -> the same product as a layer's decode batch takes it: up
//       to kLimbMaxRows rows of x gguf_matmul_limbs (gguf_blocks_int8.cpp: x as integer limbs,
//       integer dots, cheapest at one row: docs/cpu.md), more rows gguf_matmul. A row's result is
//       the same bits in any call of 1 to kLimbMaxRows rows, and in any call of more.
//
// Both run on the process's TaskPool (task_pool.h), over ranges of output rows. Every format's
// block unpacks 16 bytes at a time with SSSE3 into int8 levels, widened at the build's width
// (block_unpack.h); its scales are decoded into float factors when the block is read. The register
// tiles are GCC vector types of the build's width.

#include "kernels.h"

#include "block_unpack.h"
#include "gguf_formats.h"

#include "task_pool.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace blockserve {
namespace {

constexpr int kK = 256;  // K-quant super-block

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // exact, subnormals included
}

constexpr int8_t kNonLinear4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The factors of a K-quant's 16 sub-blocks, d * scale[j] (scale: 16 int8 at `scales`), in `out`.
inline void sub_block_factors(__m128i scales, float d, float* out) { store_scaled(scales, d, out); }

// Q4_K and Q5_K's eight 6-bit scales and mins packed in 12 bytes `s`: d * scale[j] in factor[j],
// -(dmin * min[j]) in offset[j] (j < 8).
inline void scales_mins_k4(const uint8_t* s, float d, float dmin, float* factor, float* offset) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  // bytes j < 4: the low 6 bits of s[j] (scales) and s[j + 4] (mins); j >= 4: the nibbles of s[j + 4]
  // below the top 2 bits of s[j - 4] (scales) and s[j] (mins)
  const uint32_t scales_low = w[0] & 0x3f3f3f3f, mins_low = w[1] & 0x3f3f3f3f;
  const uint32_t scales_high = (w[2] & 0x0f0f0f0f) | (((w[0] >> 6) & 0x03030303) << 4);
  const uint32_t mins_high = ((w[2] >> 4) & 0x0f0f0f0f) | (((w[1] >> 6) & 0x03030303) << 4);
  const __m128i scales = _mm_setr_epi32(int(scales_low), int(scales_high), 0, 0);
  const __m128i mins = _mm_setr_epi32(int(mins_low), int(mins_high), 0, 0);
  alignas(16) float f[16], o[16];
  store_scaled(scales, d, f);
  store_scaled(mins, -dmin, o);  // (-dmin) * m: -(dmin * m) exactly
  std::memcpy(factor, f, 8 * sizeof(float));
  std::memcpy(offset, o, 8 * sizeof(float));
}

// A block of each format, read at construction (its scales decoded), hands a piece its values 16
// at a time: piece(i, p), i < Pieces, gives values [16 i, 16 i + 16) as 16 int8 levels q and the
// float32 factors giving the values gguf-py's dequantize gives: p.scaled(q, d) for d * q,
// p.shifted(q, d, m) for d * q + m (there d * q is exact in float32, so the one rounding of the sum
// is gguf-py's). Each i is a constant where the pieces are unrolled.
struct Q4_0 {
  static constexpr int Elems = 32, Bytes = 18, Pieces = 2;
  float d;
  __m128i qs;
  explicit Q4_0(const uint8_t* b) : d(half_to_float(b)), qs(load16(b + 2)) {}
  template <typename P> void piece(int i, P& p) const {
    p.scaled(_mm_sub_epi8(i ? high_nibbles(qs) : low_nibbles(qs), _mm_set1_epi8(8)), d);
  }
};

struct Q4_1 {
  static constexpr int Elems = 32, Bytes = 20, Pieces = 2;
  float d, m;
  __m128i qs;
  explicit Q4_1(const uint8_t* b) : d(half_to_float(b)), m(half_to_float(b + 2)), qs(load16(b + 4)) {}
  template <typename P> void piece(int i, P& p) const { p.shifted(i ? high_nibbles(qs) : low_nibbles(qs), d, m); }
};

struct Q8_0 {
  static constexpr int Elems = 32, Bytes = 34, Pieces = 2;
  const uint8_t* b;
  float d;
  explicit Q8_0(const uint8_t* b) : b(b), d(half_to_float(b)) {}
  template <typename P> void piece(int i, P& p) const { p.scaled(load16(b + 2 + 16 * i), d); }
};

// Q5_0 and Q5_1: the 16 low bits of qh are the fifth bits of the low nibbles, the high 16 of the high.
inline __m128i five_bits(__m128i qs, uint32_t qh, int i) {
  const __m128i fifth = _mm_and_si128(bit_bytes(i ? qh >> 16 : qh), _mm_set1_epi8(0x10));
  return _mm_or_si128(i ? high_nibbles(qs) : low_nibbles(qs), fifth);
}

struct Q5_0 {
  static constexpr int Elems = 32, Bytes = 22, Pieces = 2;
  float d;
  uint32_t qh;
  __m128i qs;
  explicit Q5_0(const uint8_t* b) : d(half_to_float(b)), qs(load16(b + 6)) { std::memcpy(&qh, b + 2, 4); }
  template <typename P> void piece(int i, P& p) const {
    p.scaled(_mm_sub_epi8(five_bits(qs, qh, i), _mm_set1_epi8(0x10)), d);
  }
};

struct Q5_1 {
  static constexpr int Elems = 32, Bytes = 24, Pieces = 2;
  float d, m;
  uint32_t qh;
  __m128i qs;
  explicit Q5_1(const uint8_t* b) : d(half_to_float(b)), m(half_to_float(b + 2)), qs(load16(b + 8)) {
    std::memcpy(&qh, b + 4, 4);
  }
  template <typename P> void piece(int i, P& p) const { p.shifted(five_bits(qs, qh, i), d, m); }
};

inline __m128i non_linear4(__m128i nibbles) {
  return _mm_shuffle_epi8(load16(reinterpret_cast<const uint8_t*>(kNonLinear4)), nibbles);
}

struct IQ4_NL {
  static constexpr int Elems = 32, Bytes = 18, Pieces = 2;
  float d;
  __m128i qs;
  explicit IQ4_NL(const uint8_t* b) : d(half_to_float(b)), qs(load16(b + 2)) {}
  template <typename P> void piece(int i, P& p) const { p.scaled(non_linear4(i ? high_nibbles(qs) : low_nibbles(qs)), d); }
};

struct Q2_K {  // scales[16] | qs[64] | d | dmin
  static constexpr int Elems = kK, Bytes = 84, Pieces = 16;
  const uint8_t* qs;
  alignas(64) float factor[16], offset[16];  // per 16 values: d * (scale & 15), -(dmin * (scale >> 4))
  explicit Q2_K(const uint8_t* b) : qs(b + 16) {
    const __m128i scales = load16(b);
    sub_block_factors(low_nibbles(scales), half_to_float(b + 80), factor);
    sub_block_factors(high_nibbles(scales), -half_to_float(b + 82), offset);  // both products exact
  }
  template <typename P> void piece(int i, P& p) const {  // bits 2 shift of 16 bytes
    const int half = i / 8, shift = i / 2 % 4, l = i % 2;
    const __m128i q = _mm_and_si128(_mm_srli_epi16(load16(qs + half * 32 + 16 * l), 2 * shift), _mm_set1_epi8(3));
    p.shifted(q, factor[i], offset[i]);
  }
};

struct Q3_K {  // hmask[32] | qs[64] | scales[12] | d
  static constexpr int Elems = kK, Bytes = 110, Pieces = 16;
  const uint8_t* hmask;
  const uint8_t* qs;
  alignas(64) float factor[16];  // per 16 values: d * (6-bit scale - 32)
  explicit Q3_K(const uint8_t* b) : hmask(b), qs(b + 32) {
    const uint8_t* s = b + 96;
    alignas(16) int8_t scales[16];
    for (int i = 0; i < 16; ++i) {
      const int low = (s[i % 8] >> (4 * (i / 8))) & 0x0f, high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
      scales[i] = int8_t((low | (high << 4)) - 32);
    }
    sub_block_factors(_mm_load_si128(reinterpret_cast<const __m128i*>(scales)), half_to_float(b + 108), factor);
  }
  template <typename P> void piece(int i, P& p) const {  // bits 2 shift of 16 bytes, hmask bit i / 2 clear: - 4
    const int half = i / 8, shift = i / 2 % 4, l = i % 2;
    const __m128i bit = _mm_set1_epi8(char(1 << (half * 4 + shift)));
    const __m128i low = _mm_and_si128(_mm_srli_epi16(load16(qs + half * 32 + 16 * l), 2 * shift), _mm_set1_epi8(3));
    const __m128i h = _mm_and_si128(load16(hmask + 16 * l), bit);
    p.scaled(_mm_sub_epi8(low, _mm_andnot_si128(_mm_cmpeq_epi8(h, bit), _mm_set1_epi8(4))), factor[i]);
  }
};

struct Q4_K {  // d | dmin | scales[12] | qs[128]
  static constexpr int Elems = kK, Bytes = 144, Pieces = 16;
  const uint8_t* qs;
  alignas(32) float factor[8], offset[8];  // per 32 values
  explicit Q4_K(const uint8_t* b) : qs(b + 16) {
    scales_mins_k4(b + 4, half_to_float(b), half_to_float(b + 2), factor, offset);
  }
  template <typename P> void piece(int i, P& p) const {  // 64 values: the low nibbles of 32 bytes, then the high
    const __m128i q = load16(qs + 32 * (i / 4) + 16 * (i % 2));
    p.shifted(i / 2 % 2 ? high_nibbles(q) : low_nibbles(q), factor[i / 2], offset[i / 2]);
  }
};

struct Q5_K {  // d | dmin | scales[12] | qh[32] | qs[128]
  static constexpr int Elems = kK, Bytes = 176, Pieces = 16;
  const uint8_t* qh;
  const uint8_t* qs;
  alignas(32) float factor[8], offset[8];
  explicit Q5_K(const uint8_t* b) : qh(b + 16), qs(b + 48) {
    scales_mins_k4(b + 4, half_to_float(b), half_to_float(b + 2), factor, offset);
  }
  template <typename P> void piece(int i, P& p) const {  // as Q4_K's, bit i / 2 of qh the fifth
    const int sub = i / 2, half = i % 2;
    const __m128i q = load16(qs + 32 * (i / 4) + 16 * half), bit = _mm_set1_epi8(char(1 << sub));
    const __m128i high = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(load16(qh + 16 * half), bit), bit), _mm_set1_epi8(0x10));
    p.shifted(_mm_or_si128(sub % 2 ? high_nibbles(q) : low_nibbles(q), high), factor[sub], offset[sub]);
  }
};

struct Q6_K {  // ql[128] | qh[64] | scales[16] int8 | d
  static constexpr int Elems = kK, Bytes = 210, Pieces = 16;
  const uint8_t* ql;
  const uint8_t* qh;
  alignas(64) float factor[16];  // per 16 values: d * scale
  explicit Q6_K(const uint8_t* b) : ql(b), qh(b + 128) { sub_block_factors(load16(b + 192), half_to_float(b + 208), factor); }
  template <typename P> void piece(int i, P& p) const {  // a nibble of ql, bits 2 group of qh above it, - 32
    const int half = i / 8, group = i / 2 % 4, l = i % 2;
    const __m128i q = load16(ql + 64 * half + 32 * (group % 2) + 16 * l);
    const __m128i low = group / 2 ? high_nibbles(q) : low_nibbles(q);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(load16(qh + 32 * half + 16 * l), 2 * group), _mm_set1_epi8(3));
    p.scaled(_mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32)), factor[i]);
  }
};

struct IQ4_XS {  // d | scales_h (uint16) | scales_l[4] | qs[128]
  static constexpr int Elems = kK, Bytes = 136, Pieces = 16;
  const uint8_t* qs;
  alignas(64) float factor[16];  // [0, 8): per 32 values, d * (6-bit scale - 32)
  explicit IQ4_XS(const uint8_t* b) : qs(b + 8) {
    uint16_t scales_h;
    std::memcpy(&scales_h, b + 2, 2);
    alignas(16) int8_t scales[16] = {};
    for (int sub = 0; sub < 8; ++sub)
      scales[sub] = int8_t((((b[4 + sub / 2] >> (4 * (sub % 2))) & 0x0f) | (((scales_h >> (2 * sub)) & 3) << 4)) - 32);
    sub_block_factors(_mm_load_si128(reinterpret_cast<const __m128i*>(scales)), half_to_float(b), factor);
  }
  template <typename P> void piece(int i, P& p) const {
    const __m128i q = load16(qs + 16 * (i / 2));
    p.scaled(non_linear4(i % 2 ? high_nibbles(q) : low_nibbles(q)), factor[i / 2]);
  }
};

// The piece that stores gguf-py's values.
struct Store {
  float* y;
  void scaled(__m128i q, float d) { store_scaled(q, d, y); }
  void shifted(__m128i q, float d, float m) { store_scaled_plus(q, d, m, y); }
};

template <typename F>
void dequantize_row(const uint8_t* row, int64_t columns, float* out) {
  for (int64_t b = 0; b < columns / F::Elems; ++b) {
    const F block(row + b * F::Bytes);
    for (int i = 0; i < F::Pieces; ++i) {
      Store store{out + b * F::Elems + 16 * i};
      block.piece(i, store);
    }
  }
}

// Both products of weight rows with rows of x keep a tile of NR weight rows x MR rows of x as
// NR x MR vector accumulators, so each vector of weights serves MR rows and each of x serves NR.
// Every accumulator takes its products in the same order, lane l the columns l, l + kLanes, ...
// of a panel in turn, with one rounding each (explicit FMA), and the panel's sum is its lanes'
// sum by halving (lane_sums): the two products give the same bits, and so does any tile shape.
// Up to kFusedMaxRows rows of x, gguf_matmul dequantises the weights in registers (fused_tile),
// kFusedRows rows of x at a time; past it into a buffer once a call, multiplied in tiles of
// kTileWeightRows x kTileRows (tile: the shapes measured fastest, docs/cpu.md). On AVX2 (16
// registers, 8 accumulating when fused) a second pass of unpacking costs more than the buffer's
// write and read.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kTileWeightRows = 4, kTileRows = 4, kFusedRows = 4;
constexpr int64_t kFusedMaxRows = 8;
#else
constexpr int kLanes = 8, kTileWeightRows = 2, kTileRows = 6, kFusedRows = 2;
constexpr int64_t kFusedMaxRows = 2;
#endif
constexpr int kWeightRows = 4;  // NR: the switches in gguf_matmul take 1 to 4
// gguf_matmul takes K in panels of this many columns (whole blocks): 512 KiB of x at 128 rows, L2-resident.
// Fixed, not sized by the row count, so a row's sums run in the same order whatever rows share the call.
constexpr int64_t kPanelColumns = 1024;
typedef float Lanes __attribute__((vector_size(4 * kLanes)));
typedef float UnalignedLanes __attribute__((vector_size(4 * kLanes), aligned(4)));

inline Lanes load_lanes(const float* p) { return *reinterpret_cast<const UnalignedLanes*>(p); }

// acc + w * x rounded once, in every tile: left to contraction, GCC's tuning for some CPUs (Zen) keeps
// a tile's lone running sum as a multiply then an add, which rounds twice.
inline Lanes fused_multiply_add(Lanes w, Lanes x, Lanes acc) {
#if defined(__AVX512F__)
  return (Lanes)_mm512_fmadd_ps((__m512)w, (__m512)x, (__m512)acc);
#else
  return (Lanes)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)acc);
#endif
}

// sums[i] = the sum of v[i]'s lanes by halving (lanes j and j + kLanes / 2 added, then j and j +
// kLanes / 4 of those, ... down to one), for kLanes vectors at once: each step adds two vectors' halves
// side by side (two shuffles and an add per two vectors instead of a reduction per vector). The order
// is the same in every tile: the build's -fassociative-math would otherwise let each tile shape
// reassociate it (and the add of a previous panel's sum) its own way, and a row's result would depend
// on how many rows share its call (as with fused_multiply_add); the empty asm keeps each step's sums whole.
inline void lane_sums(const Lanes (&v)[kLanes], float* sums) {
#if defined(__AVX512F__)
  __m512 half[8], quarter[4], pair[2];
  for (int i = 0; i < 8; ++i) {  // vectors 2i, 2i + 1: lanes j + 8 onto j, side by side
    const __m512 a = (__m512)v[2 * i], b = (__m512)v[2 * i + 1];
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    asm("" : "+v"(half[i]));
  }
  for (int i = 0; i < 4; ++i) {  // each 8 lanes: j + 4 onto j; quarter i's 128-bit lane q: vector 4i + q
    quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                               _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xDD));
    asm("" : "+v"(quarter[i]));
  }
  for (int i = 0; i < 2; ++i) {  // each 4 lanes: j + 2 onto j (j < 2)
    pair[i] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0x44),
                            _mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0xEE));
    asm("" : "+v"(pair[i]));
  }
  // lane 4q + r: the sum of vector 4r + q
  const __m512 mixed = _mm512_add_ps(_mm512_shuffle_ps(pair[0], pair[1], 0x88), _mm512_shuffle_ps(pair[0], pair[1], 0xDD));
  _mm512_storeu_ps(sums, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                               mixed));
#else
  __m256 half[4], pair[2];
  for (int i = 0; i < 4; ++i) {  // vectors 2i, 2i + 1: lanes j + 4 onto j, side by side
    const __m256 a = (__m256)v[2 * i], b = (__m256)v[2 * i + 1];
    half[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    asm("" : "+x"(half[i]));
  }
  for (int i = 0; i < 2; ++i) {  // each 4 lanes: j + 2 onto j (j < 2); 128-bit lane h of pair i: vectors 4i + h, 4i + 2 + h
    pair[i] = _mm256_add_ps(_mm256_shuffle_ps(half[2 * i], half[2 * i + 1], 0x44),
                            _mm256_shuffle_ps(half[2 * i], half[2 * i + 1], 0xEE));
    asm("" : "+x"(pair[i]));
  }
  // lane 4h + r: the sum of vector 2r + h
  const __m256 mixed = _mm256_add_ps(_mm256_shuffle_ps(pair[0], pair[1], 0x88), _mm256_shuffle_ps(pair[0], pair[1], 0xDD));
  _mm256_storeu_ps(sums, _mm256_permutevar8x32_ps(mixed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
}

// out[m * out_stride + n] = (or += when `add`: a later panel of the same rows) acc[n][m]'s lane sum,
// kLanes accumulators at a time (the last group filled up with zeros).
template <int NR, int MR>
inline void store_sums(const Lanes (&acc)[NR][MR], float* out, int64_t out_stride, bool add) {
  constexpr int count = NR * MR, groups = (count + kLanes - 1) / kLanes;
  for (int g = 0; g < groups; ++g) {
    Lanes v[kLanes] = {};
    for (int i = 0; i < kLanes && g * kLanes + i < count; ++i) v[i] = acc[(g * kLanes + i) / MR][(g * kLanes + i) % MR];
    alignas(64) float sums[kLanes];
    lane_sums(v, sums);
    for (int i = 0; i < kLanes && g * kLanes + i < count; ++i) {
      float& o = out[(g * kLanes + i) % MR * out_stride + (g * kLanes + i) / MR];
      o = add ? o + sums[i] : sums[i];
    }
  }
}

// A panel of `columns` values (a multiple of kLanes) of dequantised weights: w's rows `columns`
// apart, x's K apart.
template <int NR, int MR>  // not inlined: GCC's AVX2 code for the inlined 4 x 3 tile ran at half speed
__attribute__((noinline)) void tile(const float* w, const float* x, int64_t columns, int64_t K, float* out,
                                    int64_t out_stride, bool add) {
  Lanes acc[NR][MR] = {};
  for (int64_t k = 0; k < columns; k += kLanes) {
    Lanes wv[NR];
    for (int n = 0; n < NR; ++n) {
      wv[n] = load_lanes(w + n * columns + k);
      asm("" : "+v"(wv[n]));  // in a register, read NR times: not a memory operand of every multiply-add
    }
    for (int m = 0; m < MR; ++m) {
      Lanes xv = load_lanes(x + m * K + k);
      asm("" : "+v"(xv));  // likewise
      for (int n = 0; n < NR; ++n) acc[n][m] = fused_multiply_add(wv[n], xv, acc[n][m]);
    }
  }
  store_sums<NR, MR>(acc, out, out_stride, add);
}

using Tile = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, bool);

template <int NR, int... MR>
constexpr std::array<Tile, sizeof...(MR)> row_tiles(std::integer_sequence<int, MR...>) {
  return {&tile<NR, MR + 1>...};
}

template <int... NR>
constexpr std::array<std::array<Tile, kTileRows>, sizeof...(NR)> tiles_of(std::integer_sequence<int, NR...>) {
  return {row_tiles<NR + 1>(std::make_integer_sequence<int, kTileRows>())...};
}

// [weight rows - 1][rows of x - 1]: the tiles up to kTileWeightRows x kTileRows
constexpr auto kTiles = tiles_of(std::make_integer_sequence<int, kTileWeightRows>());

// out[m, n] (+)= a panel of `count` dequantised weight rows w (`columns` values each) times the same
// columns of the M rows of x (rows K apart; out_stride: the row length of out), in tiles of
// kTileWeightRows weight rows by kTileRows rows of x (the last ones smaller).
void weight_rows_times_x(const float* w, int64_t count, const float* x, int64_t M, int64_t columns, int64_t K,
                         float* out, int64_t out_stride, bool add) {
  for (int64_t n = 0; n < count; n += kTileWeightRows) {
    const auto& tiles = kTiles[std::min<int64_t>(kTileWeightRows, count - n) - 1];
    for (int64_t m = 0; m < M; m += kTileRows)
      tiles[std::min<int64_t>(kTileRows, M - m) - 1](w + n * columns, x + m * K, columns, K,
                                                     out + m * out_stride + n, out_stride, add);
  }
}

// The piece that multiplies a weight row's values, as they are unpacked, with MR rows of x (K apart)
// into that weight row's accumulators.
template <int MR>
struct MultiplyInto {
  Lanes* acc;
  const float* x;
  int64_t K;
  void scaled(__m128i q, float d) {
#if defined(__AVX512F__)
    add((Lanes)_mm512_mul_ps(widen16(q), _mm512_set1_ps(d)));
#else
    const __m256 vd = _mm256_set1_ps(d);
    add((Lanes)_mm256_mul_ps(widen8(q), vd));
    add((Lanes)_mm256_mul_ps(widen8(_mm_unpackhi_epi64(q, q)), vd));
#endif
  }
  void shifted(__m128i q, float d, float m) {  // d * q exact: one rounding, as Store's
#if defined(__AVX512F__)
    add((Lanes)_mm512_fmadd_ps(widen16(q), _mm512_set1_ps(d), _mm512_set1_ps(m)));
#else
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    add((Lanes)_mm256_fmadd_ps(widen8(q), vd, vm));
    add((Lanes)_mm256_fmadd_ps(widen8(_mm_unpackhi_epi64(q, q)), vd, vm));
#endif
  }
  void add(Lanes w) {
    for (int m = 0; m < MR; ++m) acc[m] = fused_multiply_add(w, load_lanes(x + m * K), acc[m]);
    x += kLanes;
  }
};

template <typename F, int... n>
std::array<F, sizeof...(n)> blocks_of_rows(const uint8_t* w, int64_t row_bytes, std::integer_sequence<int, n...>) {
  return {F(w + n * row_bytes)...};
}

// A panel of `blocks` blocks of NR weight rows (row_bytes apart) times MR rows of x (K apart), the
// weights dequantised in registers as they are multiplied: the same sums as tile's over them. The
// rows' blocks are unpacked piece by piece side by side, so NR x MR running sums advance together.
template <typename F, int NR, int MR>
__attribute__((noinline)) void fused_tile(const uint8_t* w, int64_t row_bytes, const float* x, int64_t blocks,
                                          int64_t K, float* out, int64_t out_stride, bool add) {
  Lanes acc[NR][MR] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const auto rows = blocks_of_rows<F>(w + b * F::Bytes, row_bytes, std::make_integer_sequence<int, NR>());
#pragma GCC unroll 16
    for (int i = 0; i < F::Pieces; ++i)
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) {
        MultiplyInto<MR> piece{acc[n], x + b * F::Elems + 16 * i, K};
        rows[n].piece(i, piece);
      }
  }
  store_sums<NR, MR>(acc, out, out_stride, add);
}

using FusedTile = void (*)(const uint8_t*, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool);

template <typename F, int NR, int... MR>
constexpr std::array<FusedTile, sizeof...(MR)> fused_row_tiles(std::integer_sequence<int, MR...>) {
  return {&fused_tile<F, NR, MR + 1>...};
}

struct Format {
  int64_t elems, bytes;
  void (*dequantize_row)(const uint8_t*, int64_t, float*);
  // [one weight row, kWeightRows of them][rows of x - 1]: fused_tile for 1 .. kFusedRows rows of x
  std::array<std::array<FusedTile, kFusedRows>, 2> fused;
};

template <typename F>
constexpr Format format_of() {
  return {F::Elems, F::Bytes, &dequantize_row<F>,
          {fused_row_tiles<F, 1>(std::make_integer_sequence<int, kFusedRows>()),
           fused_row_tiles<F, kWeightRows>(std::make_integer_sequence<int, kFusedRows>())}};
}

Format format_named(const std::string& name) {
  return gguf_format_named<Format, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS>(
      name, "gguf_blocks", [](auto tag) { return format_of<typename decltype(tag)::type>(); });
}

Format checked(const at::Tensor& raw, const std::string& name, int64_t columns) {
  const Format f = format_named(name);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.stride(1) == 1 && raw.stride(0) == raw.size(1),
              "gguf_blocks: raw must be contiguous uint8 [rows, row bytes]");
  TORCH_CHECK(columns > 0 && columns % f.elems == 0 && raw.size(1) == columns / f.elems * f.bytes, "gguf_blocks: ",
              name, " rows of ", columns, " values take ", columns / f.elems * f.bytes, " bytes (", f.elems,
              " per ", f.bytes, "-byte block), not ", raw.size(1));
  return f;
}

// out's columns [n0, n0 + count) over one panel of K (`columns` values from k0), with the weights
// dequantised in registers: kWeightRows rows at a time (the rest one by one) times kFusedRows rows
// of x at a time.
void fused_rows(const Format& f, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
                int64_t n0, int64_t count, int64_t k0, int64_t columns, float* out, int64_t N) {
  const uint8_t* wk = w + k0 / f.elems * f.bytes;
  for (int64_t n = 0; n < count;) {
    const int weight_rows = count - n >= kWeightRows ? kWeightRows : 1;
    const auto& tiles = f.fused[weight_rows == kWeightRows];
    for (int64_t m = 0; m < M; m += kFusedRows) {
      const int64_t rows = std::min<int64_t>(kFusedRows, M - m);
      tiles[rows - 1](wk + (n0 + n) * row_bytes, row_bytes, x + m * K + k0, columns / f.elems, K,
                      out + m * N + n0 + n, N, k0 > 0);
    }
    n += weight_rows;
  }
}

// The same through a buffer of kWeightRows dequantised rows (`rows`, kWeightRows x panel floats).
void buffered_rows(const Format& f, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
                   int64_t n0, int64_t count, int64_t k0, int64_t columns, float* out, int64_t N, float* rows) {
  const uint8_t* wk = w + k0 / f.elems * f.bytes;
  for (int64_t r = 0; r < count; ++r) f.dequantize_row(wk + (n0 + r) * row_bytes, columns, rows + r * columns);
  // the next group's blocks of this panel, fetched while these rows are multiplied (the panels of
  // successive groups lie row_bytes apart, a stride the hardware prefetchers do not follow far enough)
  const int64_t panel_bytes = columns / f.elems * f.bytes;
  for (int64_t r = n0 + count; r < std::min(N, n0 + count + kWeightRows); ++r)
    for (int64_t b = 0; b < panel_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(wk + r * row_bytes + b), _MM_HINT_T0);
  weight_rows_times_x(rows, count, x + k0, M, columns, K, out + n0, N, k0 > 0);
}

}  // namespace

std::vector<std::string> gguf_block_formats() { return {kGgufFormatNames.begin(), kGgufFormatNames.end()}; }

at::Tensor gguf_dequantize(at::Tensor raw, const std::string& format, int64_t columns) {
  const Format f = checked(raw, format, columns);
  const int64_t rows = raw.size(0), row_bytes = raw.size(1);
  auto out = at::empty({rows, columns}, at::kFloat);
  const uint8_t* w = raw.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  for_each_range(rows, std::max<int64_t>(1, (1 << 16) / columns), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) f.dequantize_row(w + n * row_bytes, columns, o + n * columns);
  });
  return out;
}

at::Tensor gguf_matmul(at::Tensor x, at::Tensor raw, const std::string& format) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_matmul: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = raw.size(0);
  const Format f = checked(raw, format, K);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const uint8_t* w = raw.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row_bytes = raw.size(1);
  // tasks of kWeightRows output rows at a time, >= ~64 K multiply-adds each. K is taken in panels of
  // kPanelColumns (whole blocks). Up to kFusedMaxRows rows of x (a few KiB per panel) each weight row
  // is read through, panel after panel, dequantised in registers once per kFusedRows rows of x; past
  // it each panel runs over all of a task's rows, so x's panel stays in L2 across them, each weight
  // dequantised once into the buffer. Either way a row's result does not depend on M.
  const int64_t groups = (N + kWeightRows - 1) / kWeightRows;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (K * M * kWeightRows));
  const int64_t panel = std::min(K, std::max<int64_t>(1, kPanelColumns / f.elems) * f.elems);
  if (M <= kFusedMaxRows) {
    for_each_range(groups, grain, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n0 = g * kWeightRows, count = std::min<int64_t>(kWeightRows, N - n0);
        for (int64_t k0 = 0; k0 < K; k0 += panel)
          fused_rows(f, w, row_bytes, xp, M, K, n0, count, k0, std::min(panel, K - k0), o, N);
      }
    });
    return out;
  }
  for_each_range(groups, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kWeightRows * panel);
    for (int64_t k0 = 0; k0 < K; k0 += panel)
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n0 = g * kWeightRows, count = std::min<int64_t>(kWeightRows, N - n0);
        buffered_rows(f, w, row_bytes, xp, M, K, n0, count, k0, std::min(panel, K - k0), o, N, rows.data());
      }
  });
  return out;
}

// Up to this many rows (a few decodes, or a batch-1 verification's k + 1 <= 8 rows, which must get the
// bits of decoding alone) the limbs' integer dots serve.
constexpr int64_t kLimbMaxRows = 8;

at::Tensor gguf_matmul_decode(at::Tensor x, at::Tensor raw, const std::string& format) {
  TORCH_CHECK(x.dim() == 2, "gguf_matmul_decode: x must be float32 [M, K]");
  return x.size(0) <= kLimbMaxRows ? gguf_matmul_limbs(std::move(x), std::move(raw), format)
                                   : gguf_matmul(std::move(x), std::move(raw), format);
}

}  // namespace blockserve
