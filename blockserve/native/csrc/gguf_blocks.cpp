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
//       four output rows at a time are dequantised into a per-task buffer of 4 x K floats (L1/L2)
//       and multiplied with the M rows of x in register tiles (4 weight rows x 4 rows of x on
//       AVX-512, 4 x 3 on AVX2), so each weight is dequantised once per call whatever M is and
//       the weights are read from memory at their file size. When x passes 512 KiB, K is taken in
//       panels of whole blocks sized so x's panel stays in L2 across a task's weight rows, each
//       panel's sums added to the last's.
//
// Both run on the process's TaskPool (task_pool.h), over ranges of output rows. Every format's
// dequantiser unpacks 16 bytes at a time with SSSE3 and widens them at the build's width
// (block_unpack.h); Q3_K's 16 sub-block scales are decoded by a plain loop first. The register
// tiles are GCC vector types of the build's width.

#include "kernels.h"

#include "block_unpack.h"

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

// Q4_K and Q5_K's eight 6-bit scales and mins packed in 12 bytes.
inline void scale_min_k4(const uint8_t* s, int j, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Each format's unpack(b, piece) hands the piece its block's values 16 at a time, in order, as 16
// int8 levels q and the float32 factors giving the values gguf-py's dequantize gives:
// piece.scaled(q, d) for d * q, piece.shifted(q, d, m) for d * q + m (there d * q is exact in
// float32, so the one rounding of the sum is gguf-py's).
struct Q4_0 {
  static constexpr int Elems = 32, Bytes = 18;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const float d = half_to_float(b);
    const __m128i qs = load16(b + 2), eight = _mm_set1_epi8(8);
    piece.scaled(_mm_sub_epi8(low_nibbles(qs), eight), d);
    piece.scaled(_mm_sub_epi8(high_nibbles(qs), eight), d);
  }
};

struct Q4_1 {
  static constexpr int Elems = 32, Bytes = 20;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    const __m128i qs = load16(b + 4);
    piece.shifted(low_nibbles(qs), d, m);
    piece.shifted(high_nibbles(qs), d, m);
  }
};

struct Q8_0 {
  static constexpr int Elems = 32, Bytes = 34;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const float d = half_to_float(b);
    piece.scaled(load16(b + 2), d);
    piece.scaled(load16(b + 18), d);
  }
};

struct Q5_0 {
  static constexpr int Elems = 32, Bytes = 22;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const float d = half_to_float(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m128i qs = load16(b + 6), fifth = _mm_set1_epi8(0x10);
    const __m128i low = _mm_or_si128(low_nibbles(qs), _mm_and_si128(bit_bytes(qh), fifth));
    const __m128i high = _mm_or_si128(high_nibbles(qs), _mm_and_si128(bit_bytes(qh >> 16), fifth));
    piece.scaled(_mm_sub_epi8(low, fifth), d);
    piece.scaled(_mm_sub_epi8(high, fifth), d);
  }
};

struct Q5_1 {
  static constexpr int Elems = 32, Bytes = 24;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const __m128i qs = load16(b + 8), fifth = _mm_set1_epi8(0x10);
    piece.shifted(_mm_or_si128(low_nibbles(qs), _mm_and_si128(bit_bytes(qh), fifth)), d, m);
    piece.shifted(_mm_or_si128(high_nibbles(qs), _mm_and_si128(bit_bytes(qh >> 16), fifth)), d, m);
  }
};

struct IQ4_NL {
  static constexpr int Elems = 32, Bytes = 18;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const __m128i table = load16(reinterpret_cast<const uint8_t*>(kNonLinear4)), qs = load16(b + 2);
    const float d = half_to_float(b);
    piece.scaled(_mm_shuffle_epi8(table, low_nibbles(qs)), d);
    piece.scaled(_mm_shuffle_epi8(table, high_nibbles(qs)), d);
  }
};

struct Q2_K {  // scales[16] | qs[64] | d | dmin
  static constexpr int Elems = kK, Bytes = 84;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const uint8_t* scales = b;
    const uint8_t* qs = b + 16;
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    const __m128i three = _mm_set1_epi8(3);
    for (int half = 0; half < 2; ++half)
      for (int shift = 0; shift < 4; ++shift)
        for (int l = 0; l < 2; ++l) {  // 16 weights from bits 2 shift of 16 bytes, sharing scales[w / 16]
          const int w = half * 128 + shift * 32 + 16 * l;
          const uint8_t sc = scales[w / 16];
          const __m128i q = _mm_and_si128(_mm_srli_epi16(load16(qs + half * 32 + 16 * l), 2 * shift), three);
          piece.shifted(q, d * float(sc & 0x0f), -(dmin * float(sc >> 4)));  // both products exact
        }
  }
};

struct Q3_K {  // hmask[32] | qs[64] | scales[12] | d
  static constexpr int Elems = kK, Bytes = 110;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const uint8_t* hmask = b;
    const uint8_t* qs = b + 32;
    const uint8_t* s = b + 96;
    const float d = half_to_float(b + 108);
    float dl[16];
    for (int i = 0; i < 16; ++i) {
      const int low = (s[i % 8] >> (4 * (i / 8))) & 0x0f, high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
      dl[i] = d * float((low | (high << 4)) - 32);
    }
    const __m128i three = _mm_set1_epi8(3), four = _mm_set1_epi8(4);
    for (int half = 0; half < 2; ++half)
      for (int shift = 0; shift < 4; ++shift) {
        const __m128i bit = _mm_set1_epi8(char(1 << (half * 4 + shift)));  // hmask bit w / 32 of weight w
        for (int l = 0; l < 2; ++l) {
          const int w = half * 128 + shift * 32 + 16 * l;
          const __m128i low = _mm_and_si128(_mm_srli_epi16(load16(qs + half * 32 + 16 * l), 2 * shift), three);
          const __m128i h = _mm_and_si128(load16(hmask + 16 * l), bit);
          piece.scaled(_mm_sub_epi8(low, _mm_andnot_si128(_mm_cmpeq_epi8(h, bit), four)), dl[w / 16]);
        }
      }
  }
};

struct Q4_K {  // d | dmin | scales[12] | qs[128]
  static constexpr int Elems = kK, Bytes = 144;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* qs = b + 16;
    for (int chunk = 0; chunk < 4; ++chunk) {  // 64 weights: the low nibbles of 32 bytes, then the high
      for (int part = 0; part < 2; ++part) {
        uint8_t sc, m;
        scale_min_k4(b + 4, 2 * chunk + part, &sc, &m);
        const float scale = d * float(sc), min = -(dmin * float(m));
        for (int half = 0; half < 2; ++half) {
          const __m128i q = load16(qs + 32 * chunk + 16 * half);
          piece.shifted(part ? high_nibbles(q) : low_nibbles(q), scale, min);
        }
      }
    }
  }
};

struct Q5_K {  // d | dmin | scales[12] | qh[32] | qs[128]
  static constexpr int Elems = kK, Bytes = 176;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    for (int chunk = 0; chunk < 4; ++chunk) {
      for (int part = 0; part < 2; ++part) {
        const int sub = 2 * chunk + part;
        uint8_t sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const float scale = d * float(sc), min = -(dmin * float(m));
        const __m128i bit = _mm_set1_epi8(char(1 << sub)), fifth = _mm_set1_epi8(0x10);
        for (int half = 0; half < 2; ++half) {
          const __m128i q = load16(qs + 32 * chunk + 16 * half), h = load16(qh + 16 * half);
          const __m128i high = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, bit), bit), fifth);
          piece.shifted(_mm_or_si128(part ? high_nibbles(q) : low_nibbles(q), high), scale, min);
        }
      }
    }
  }
};

struct Q6_K {  // ql[128] | qh[64] | scales[16] int8 | d
  static constexpr int Elems = kK, Bytes = 210;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    for (int half = 0; half < 2; ++half)
      for (int group = 0; group < 4; ++group) {
        const int w0 = 128 * half + 32 * group;
        const __m128i three = _mm_set1_epi8(3);
        for (int l = 0; l < 2; ++l) {  // 16 values sharing scales[w0 / 16 + l]
          const __m128i q = load16(ql + 64 * half + 32 * (group % 2) + 16 * l);
          const __m128i low = group / 2 ? high_nibbles(q) : low_nibbles(q);
          const __m128i high = _mm_and_si128(_mm_srli_epi16(load16(qh + 32 * half + 16 * l), 2 * group), three);
          const __m128i value = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
          piece.scaled(value, d * float(scales[w0 / 16 + l]));
        }
      }
  }
};

struct IQ4_XS {  // d | scales_h (uint16) | scales_l[4] | qs[128]
  static constexpr int Elems = kK, Bytes = 136;
  template <typename P> static void unpack(const uint8_t* b, P& piece) {
    const float d = half_to_float(b);
    uint16_t scales_h;
    std::memcpy(&scales_h, b + 2, 2);
    const uint8_t* scales_l = b + 4;
    const uint8_t* qs = b + 8;
    const __m128i table = load16(reinterpret_cast<const uint8_t*>(kNonLinear4));
    for (int sub = 0; sub < 8; ++sub) {
      const int scale = (((scales_l[sub / 2] >> (4 * (sub % 2))) & 0x0f) | (((scales_h >> (2 * sub)) & 3) << 4)) - 32;
      const float dl = d * float(scale);
      const __m128i q = load16(qs + 16 * sub);
      piece.scaled(_mm_shuffle_epi8(table, low_nibbles(q)), dl);
      piece.scaled(_mm_shuffle_epi8(table, high_nibbles(q)), dl);
    }
  }
};

// The piece that stores gguf-py's values.
struct Store {
  float* y;
  void scaled(__m128i q, float d) {
    store_scaled(q, d, y);
    y += 16;
  }
  void shifted(__m128i q, float d, float m) {
    store_scaled_plus(q, d, m, y);
    y += 16;
  }
};

template <typename F>
void dequantize_row(const uint8_t* row, int64_t columns, float* out) {
  Store store{out};
  for (int64_t b = 0; b < columns / F::Elems; ++b) F::unpack(row + b * F::Bytes, store);
}

// Both products of weight rows with rows of x keep a tile of NR weight rows x MR rows of x as
// NR x MR vector accumulators, so each vector of weights serves MR rows and each of x serves NR.
// Every accumulator takes its products in the same order, lane l the columns l, l + kLanes, ...
// of a panel in turn, with one rounding each (explicit FMA), and the panel's sum is its lanes'
// sum by halving (lane_sum): the two products give the same bits, and so does any tile shape.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kTileRows = 4, kFusedRows = 4;
#else
constexpr int kLanes = 8, kTileRows = 3, kFusedRows = 2;  // 16 ymm registers: 8 accumulate when fused
#endif
constexpr int kWeightRows = 4;  // NR: the switches in gguf_matmul take 1 to 4
// gguf_matmul takes K in panels of this many columns (whole blocks): 512 KiB of x at 128 rows, L2-resident.
// Fixed, not sized by the row count, so a row's sums run in the same order whatever rows share the call.
constexpr int64_t kPanelColumns = 1024;
// Up to this many rows of x, gguf_matmul dequantises the weights in registers (fused_tile), kFusedRows
// rows of x at a time; past it into a buffer once a call (tile).
constexpr int64_t kFusedMaxRows = 8;
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

// The lanes' sum by halving, in the same order in every tile: the build's -fassociative-math would
// otherwise let each tile shape reassociate it (and the add of a previous panel's sum) its own way,
// and a row's result would depend on how many rows share its call (as with fused_multiply_add). The
// empty asm hides the sum's value, so it is added to a panel's running sum whole.
inline float lane_sum(Lanes v) {
#if defined(__AVX512F__)
  const __m512 all = reinterpret_cast<__m512&>(v);
  const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(all), _mm512_extractf32x8_ps(all, 1));
#else
  const __m256 eight = reinterpret_cast<__m256&>(v);
#endif
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  float s = _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
  asm("" : "+x"(s));
  return s;
}

// out[m * out_stride + n] = (or += when `add`: a later panel of the same rows) acc[n][m]'s lane sum.
template <int NR, int MR>
inline void store_sums(const Lanes (&acc)[NR][MR], float* out, int64_t out_stride, bool add) {
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) {
      float& o = out[m * out_stride + n];
      o = add ? o + lane_sum(acc[n][m]) : lane_sum(acc[n][m]);
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
    for (int n = 0; n < NR; ++n) wv[n] = load_lanes(w + n * columns + k);
    for (int m = 0; m < MR; ++m) {
      const Lanes xv = load_lanes(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[n][m] = fused_multiply_add(wv[n], xv, acc[n][m]);
    }
  }
  store_sums<NR, MR>(acc, out, out_stride, add);
}

// out[m, n] (+)= a panel of NR dequantised weight rows w (`columns` values each) times the same
// columns of the M rows of x (rows K apart; out_stride: the row length of out).
template <int NR>
void weight_rows_times_x(const float* w, const float* x, int64_t M, int64_t columns, int64_t K, float* out,
                         int64_t out_stride, bool add) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    tile<NR, kTileRows>(w, x + m * K, columns, K, out + m * out_stride, out_stride, add);
  switch (M - m) {
    case 1: tile<NR, 1>(w, x + m * K, columns, K, out + m * out_stride, out_stride, add); break;
    case 2: tile<NR, 2>(w, x + m * K, columns, K, out + m * out_stride, out_stride, add); break;
    case 3: tile<NR, 3>(w, x + m * K, columns, K, out + m * out_stride, out_stride, add); break;
    default: break;
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

// A panel of `blocks` blocks of NR weight rows (row_bytes apart) times MR rows of x (K apart), the
// weights dequantised in registers as they are multiplied: the same sums as tile's over them.
template <typename F, int NR, int MR>
__attribute__((noinline)) void fused_tile(const uint8_t* w, int64_t row_bytes, const float* x, int64_t blocks,
                                          int64_t K, float* out, int64_t out_stride, bool add) {
  Lanes acc[NR][MR] = {};
  for (int64_t b = 0; b < blocks; ++b)
    for (int n = 0; n < NR; ++n) {
      MultiplyInto<MR> piece{acc[n], x + b * F::Elems, K};
      F::unpack(w + n * row_bytes + b * F::Bytes, piece);
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
  if (name == "Q4_0") return format_of<Q4_0>();
  if (name == "Q4_1") return format_of<Q4_1>();
  if (name == "Q8_0") return format_of<Q8_0>();
  if (name == "Q5_0") return format_of<Q5_0>();
  if (name == "Q5_1") return format_of<Q5_1>();
  if (name == "IQ4_NL") return format_of<IQ4_NL>();
  if (name == "Q2_K") return format_of<Q2_K>();
  if (name == "Q3_K") return format_of<Q3_K>();
  if (name == "Q4_K") return format_of<Q4_K>();
  if (name == "Q5_K") return format_of<Q5_K>();
  if (name == "Q6_K") return format_of<Q6_K>();
  if (name == "IQ4_XS") return format_of<IQ4_XS>();
  TORCH_CHECK(false, "gguf_blocks: no kernel for GGUF format ", name,
              " (read: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)");
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
  const float* xk = x + k0;
  switch (count) {
    case 4: weight_rows_times_x<4>(rows, xk, M, columns, K, out + n0, N, k0 > 0); break;
    case 3: weight_rows_times_x<3>(rows, xk, M, columns, K, out + n0, N, k0 > 0); break;
    case 2: weight_rows_times_x<2>(rows, xk, M, columns, K, out + n0, N, k0 > 0); break;
    default: weight_rows_times_x<1>(rows, xk, M, columns, K, out + n0, N, k0 > 0); break;
  }
}

}  // namespace

std::vector<std::string> gguf_block_formats() {
  return {"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"};
}

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

}  // namespace blockserve
