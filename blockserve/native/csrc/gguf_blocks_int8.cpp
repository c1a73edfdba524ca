// out = x @ W^T over GGUF blocks in the file's own layout (gguf_blocks.cpp's formats, [rows, row
// bytes]), with x rounded to int8 per block of 32 (block_levels.h, as quantized_matmul_int8 rounds
// it and llama.cpp's q8 activations do) and integer dot products:
//
//   gguf_matmul_int8(x, raw, format) -> out [M, N] = sum over x's blocks b of 32 values:
//       s_b * (a_b * (q_b . r_b)) + c_b * (s_b * sum(r_b))
//   r_b, s_b: x's levels and scale in block b; q_b the weights' integer levels there, a_b their float
//   factor (d, or d times a 6-bit sub-block scale) and c_b the constant term (a min, or none). So out
//   is (x rounded) @ W^T with W gguf-py's dequantised weights, up to float32 rounding: only the
//   rounding of x differs from gguf_matmul.
//   gguf_matmul_limbs(x, raw, format) -> x @ W^T itself, to float32 rounding: each row of x taken as
//       four rows of integer limbs (block_limbs.h) through the same dots, the four results summed
//       per output, most significant first.
//
// Where a format's sub-block scales cover 16 values (Q2_K, Q3_K, Q6_K), they are integers folded into
// the integer sum (the pair products multiplied by them in madd, or on VNNI each lane's sum of 4
// products, all in one sub-block). Levels stored with an offset
// (Q4_0: q - 8, Q5_0: q - 16, Q3_K: q - 4, Q6_K: q - 32) multiply as the unsigned q, the offset
// (times the sub-block scale) times the sum of x's levels per 16 values taken off in integers; Q2_K's
// 16-value mins take those sums too. Other signed levels (Q8_0, IQ4_NL, IQ4_XS) multiply as |q| times
// x's levels with q's sign (u8 x s8 products); AVX-512 VNNI builds multiply q + 128 instead and take
// 128 times x's sums off. Every integer sum is exact; a block's sum is converted to float32 once
// (exact below 2^24 and within one rounding above).
//
// Layout: the weights of 256 columns of a row (one K-quant super-block, or eight 32-value blocks) are
// unpacked in registers into eight 256-bit vectors of levels whose 32-bit lanes each hold 4 levels of
// one block (a Layout: the raw bytes moved by 4x4 transposes of 32-bit lanes, then the nibbles and
// high bits taken out), so a multiply-add of bytes (dpbusd on VNNI, maddubs + madd elsewhere) sums
// each block in its own lanes, with no horizontal sum per block. x is rounded once per call and its
// levels laid out the same way. Each block's integer sum meets its factors in one fused multiply-add
// per lane, in the order of K, and the lanes are summed at the end of the row: each output is one
// running sum in a fixed order, so a row's result is the same bits whatever else shares its call.
// Up to 4 rows of x, each weight chunk is unpacked and dotted with every row of x at once; with more,
// 16 weight rows are unpacked into a per-task buffer (L2) and dotted with the rows of x 4 at a time.

#include "gguf_blocks_int8.h"
#include "kernels.h"

#include "block_levels.h"
#include "block_limbs.h"
#include "block_unpack.h"
#include "gguf_formats.h"
#include "task_pool.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace blockserve {
namespace {

constexpr int kBlock = 32;        // values per block of x's levels
constexpr int kChunkBlocks = 8;   // blocks of 32 per chunk
constexpr int kChunk = kBlock * kChunkBlocks;
constexpr int kTileRows = 4;      // rows of x dotted with each unpacked weight chunk at once
constexpr int kRowBlock = 16;     // weight rows unpacked together when x has more than kTileRows rows

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// Where a chunk's 64 dwords of levels (block * 8 + dword within the block) sit in its eight vectors.
struct Layout {
  uint8_t source[8][8];  // vector v, lane L: the dword it holds
  uint8_t order[8];      // lane L of the block sums: its block
  bool halves;           // vectors 0-3 and 4-7 each hold 4 blocks, twice (lanes 0-3 and 4-7): the two
                         // halves' sums are added; otherwise every vector holds all 8 blocks
};

// Lane L: block L; vector v: dword v (32-value blocks: the low nibbles of dword v < 4, the high of v - 4)
constexpr Layout blocks_layout() {
  Layout l{};
  for (int v = 0; v < 8; ++v)
    for (int L = 0; L < 8; ++L) l.source[v][L] = uint8_t(8 * L + v);
  for (int L = 0; L < 8; ++L) l.order[L] = uint8_t(L);
  return l;
}

// Vectors 0-3 hold blocks `low` (lanes L and L + 4: block low[L], dwords v and v + 4), 4-7 `high`.
constexpr Layout paired_layout(int l0, int l1, int l2, int l3, int h0, int h1, int h2, int h3) {
  const int low[4] = {l0, l1, l2, l3}, high[4] = {h0, h1, h2, h3};
  Layout l{};
  for (int v = 0; v < 8; ++v)
    for (int L = 0; L < 8; ++L) l.source[v][L] = uint8_t(8 * (v < 4 ? low : high)[L % 4] + v % 4 + 4 * (L / 4));
  for (int L = 0; L < 4; ++L) {
    l.order[L] = uint8_t(low[L]);
    l.order[L + 4] = uint8_t(high[L]);
  }
  l.halves = true;
  return l;
}

constexpr bool natural(const Layout& l) {
  for (int L = 0; L < 8; ++L)
    if (l.order[L] != L) return false;
  return true;
}

constexpr Layout kBlocks = blocks_layout();
constexpr Layout kNibbles = paired_layout(0, 2, 4, 6, 1, 3, 5, 7);  // Q4_K, Q5_K: 32 bytes' low, high nibbles
constexpr Layout kPlanes = paired_layout(0, 1, 4, 5, 2, 3, 6, 7);   // Q2_K, Q3_K, Q6_K: bit planes of 2 halves
constexpr Layout kBytes = paired_layout(0, 1, 2, 3, 4, 5, 6, 7);    // Q8_0: 32 bytes per block

// One weight row's 256 columns as the dot products take them.
struct alignas(32) Weights {
  __m256i u[8];     // unsigned levels (the Layout's vectors): |q|, or q + 128 (VNNI), for signed formats
  __m256i q[8];     // signed formats without VNNI: the levels, whose signs move onto x's
  __m256i sub[2];   // 16-value sub-blocks: the integer scale of each pair product, vectors 0-3 and 4-7
  __m256i offset;   // lane L's block: its two 16 values' offsets times their sub-block scale (int16)
  __m256i mins;     // Q2_K: lane L's block: its two 16-value integer mins
  __m256 scale;     // a_b per lane
  __m256 constant;  // c_b per lane (Q2_K: of s_b * the mins' dot)
};

// x's rows rounded, per chunk of 256 columns, laid out as the format's weights.
struct alignas(32) XChunk {
  int8_t r[8][32];     // levels, vector v as the weights' vector v
  float s[8], sum[8];  // lane L's block: s_b and s_b * sum(r_b)
  int16_t sum16[16];   // lane L's block: the sums of its first and last 16 levels
};

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // exact, subnormals included
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i bytes(int8_t v) { return _mm256_set1_epi8(v); }
inline __m256i low_nibbles256(__m256i v) { return _mm256_and_si256(v, bytes(0x0f)); }
inline __m256i high_nibbles256(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), bytes(0x0f)); }

// Per 128-bit half, the 4x4 transpose of 32-bit lanes: r_i's lane L <- r_L's lane i (L < 4), so lane
// L of the result holds dword i (lanes 0-3) or i + 4 (lanes 4-7) of input L % 4.
inline void transpose4(__m256i& r0, __m256i& r1, __m256i& r2, __m256i& r3) {
  const __m256i a0 = _mm256_unpacklo_epi32(r0, r1), a1 = _mm256_unpackhi_epi32(r0, r1);
  const __m256i a2 = _mm256_unpacklo_epi32(r2, r3), a3 = _mm256_unpackhi_epi32(r2, r3);
  r0 = _mm256_unpacklo_epi64(a0, a2);
  r1 = _mm256_unpackhi_epi64(a0, a2);
  r2 = _mm256_unpacklo_epi64(a1, a3);
  r3 = _mm256_unpackhi_epi64(a1, a3);
}

// Dword i of v in lanes 0-3, dword i + 4 in lanes 4-7.
inline __m256i spread_dword(__m256i v, int i) {
  return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(i, i, i, i, i + 4, i + 4, i + 4, i + 4));
}

inline __m256i shift_right(__m256i v, int a, int b, int c, int d) {
  return _mm256_srlv_epi32(v, _mm256_setr_epi32(a, b, c, d, a, b, c, d));
}

// Each 32-bit lane: byte 0 = byte idx of its 128-bit half (of 16 bytes broadcast), bytes 1-3 zero; -1: all zero.
inline __m256i pick_bytes(__m256i v, int a, int b, int c, int d, int e, int f, int g, int h) {
  const auto lane = [](int i) { return i < 0 ? -1 : int(0xffffff00u | unsigned(i)); };
  return _mm256_shuffle_epi8(v, _mm256_setr_epi32(lane(a), lane(b), lane(c), lane(d), lane(e), lane(f), lane(g), lane(h)));
}

// The int8 bytes of v picked by idx, as int16.
inline __m256i words(__m128i v, __m128i idx) { return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(v, idx)); }

inline __m128i idx16(int8_t a0, int8_t a1, int8_t a2, int8_t a3, int8_t a4, int8_t a5, int8_t a6, int8_t a7) {
  return _mm_setr_epi8(a0, a0, a1, a1, a2, a2, a3, a3, a4, a4, a5, a5, a6, a6, a7, a7);
}

// The kPlanes layout's 16-value scales from 16 per-16-value bytes (block j: bytes 2j, 2j + 1):
// sub[h] words of lane L: block (h ? high : low)[L % 4]'s scale of its first (L < 4) or last 16 values;
// the pairs in lane order (for offsets and mins) as words 2L, 2L + 1.
const __m128i kPlanesLow = idx16(0, 2, 8, 10, 1, 3, 9, 11), kPlanesHigh = idx16(4, 6, 12, 14, 5, 7, 13, 15);
inline __m128i planes_pairs() { return _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15); }

template <typename F> constexpr bool kSignFlip = F::Signed && kVnni;  // levels multiplied as q + 128
template <typename F> constexpr bool kTakesSums = F::Offset || F::SubMins || kSignFlip<F>;

// A signed level vector v of w.
inline void set_signed(Weights& w, int v, __m256i q) {
  if constexpr (kVnni) {
    w.u[v] = _mm256_xor_si256(q, bytes(int8_t(0x80)));
  } else {
    w.q[v] = q;
    w.u[v] = _mm256_sign_epi8(q, q);
  }
}

// 8 float16 at p + j * Stride, as float32 (built in registers: a wide load of narrow stores would stall).
template <int Stride>
inline __m256 halves8(const uint8_t* p) {
  const auto h = [p](int j) {
    int16_t v;
    std::memcpy(&v, p + j * Stride, 2);
    return v;
  };
  return _mm256_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7)));
}

// 8 uint32 at p + j * Stride.
template <int Stride>
inline __m256i dwords8(const uint8_t* p) {
  const auto d = [p](int j) {
    int32_t v;
    std::memcpy(&v, p + j * Stride, 4);
    return v;
  };
  return _mm256_setr_epi32(d(0), d(1), d(2), d(3), d(4), d(5), d(6), d(7));
}

// Eight 32-value blocks' 16 bytes of 4-bit levels (at qs(j) for block j; value i < 16 in the low
// nibble of byte i, value 16 + i in its high) in kBlocks' layout: t[v] low nibbles, t[v + 4] high.
template <typename QS>
inline void nibble_blocks(QS qs, __m256i t[8]) {
  for (int j = 0; j < 4; ++j) t[j] = _mm256_set_m128i(load16(qs(j + 4)), load16(qs(j)));
  transpose4(t[0], t[1], t[2], t[3]);
  for (int v = 0; v < 4; ++v) {
    t[v + 4] = high_nibbles256(t[v]);
    t[v] = low_nibbles256(t[v]);
  }
}

// 0x10 in byte b of lane L where bit 4 v + b of qh's lane L is set (Q5_0 / Q5_1's fifth bits, kBlocks).
inline __m256i fifth_bits(__m256i qh, int v) {
  const __m256i from = _mm256_add_epi8(bytes(int8_t(v / 2)), _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                                              0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  const __m256i bit = _mm256_set1_epi32(int(0x08040201u << (4 * (v % 2))));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, from), bit), bit), bytes(0x10));
}

// Q4_K and Q5_K's eight 6-bit scales and mins (12 bytes at s, gguf_blocks.cpp's layout) in kNibbles'
// lane order: a_b = d * scale, c_b = -(dmin * min).
inline void k4_factors(const uint8_t* s, float d, float dmin, Weights& w) {
  const __m256i b = _mm256_broadcastsi128_si256(load16(s));
  const __m256i six = _mm256_setr_epi32(63, 63, 15, 15, 63, 63, 15, 15), top = _mm256_set1_epi32(0x30);
  // blocks 0 2 4 6 1 3 5 7; j < 4: s[j] & 63, s[j + 4] & 63; j >= 4: the low / high nibble of s[j + 4]
  // with the top 2 bits of s[j - 4] / s[j] above
  const __m256i scale = _mm256_or_si256(_mm256_and_si256(pick_bytes(b, 0, 2, 8, 10, 1, 3, 9, 11), six),
                                        _mm256_and_si256(_mm256_srli_epi32(pick_bytes(b, -1, -1, 0, 2, -1, -1, 1, 3), 2), top));
  const __m256i min = _mm256_or_si256(
      _mm256_and_si256(_mm256_srlv_epi32(pick_bytes(b, 4, 6, 8, 10, 5, 7, 9, 11), _mm256_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4)), six),
      _mm256_and_si256(_mm256_srli_epi32(pick_bytes(b, -1, -1, 4, 6, -1, -1, 5, 7), 2), top));
  w.scale = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(scale));  // exact, as gguf-py's product
  w.constant = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(min)), _mm256_set1_ps(-0.f));
}

// 16 int8 sub-block scales (block j: 2j, 2j + 1) as kPlanes' sub, and as offsets (times 2^offset_shift).
inline void planes_scales(__m128i scales, int offset_shift, Weights& w) {
  w.sub[0] = words(scales, kPlanesLow);
  w.sub[1] = words(scales, kPlanesHigh);
  w.offset = _mm256_sll_epi16(words(scales, planes_pairs()), _mm_cvtsi32_si128(offset_shift));
}

constexpr int8_t kNonLinear4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
inline __m256i non_linear(__m256i nibbles) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kNonLinear4))), nibbles);
}

// Each format: Elems values in Bytes per block; unpack(b, w) the 256 columns at b (a super-block, or
// 8 blocks) into w in its Layout. Signed: levels of either sign; SubScales: 16-value integer scales;
// Offset: levels stored as q + offset; Constant: a constant term (c_b); SubMins: Q2_K's 16-value mins;
// MaxLevel: the largest unsigned level (how many byte products int16 holds summed).
struct Traits {
  static constexpr bool Signed = false, SubScales = false, Offset = false, Constant = false, SubMins = false;
};

struct Q4_0 : Traits {
  static constexpr int Elems = 32, Bytes = 18, MaxLevel = 15;
  static constexpr bool Offset = true;
  static constexpr const Layout& layout = kBlocks;
  static void unpack(const uint8_t* b, Weights& w) {
    nibble_blocks([b](int j) { return b + j * Bytes + 2; }, w.u);
    w.offset = _mm256_set1_epi16(8);
    w.scale = halves8<Bytes>(b);
  }
};

struct Q4_1 : Traits {
  static constexpr int Elems = 32, Bytes = 20, MaxLevel = 15;
  static constexpr bool Constant = true;
  static constexpr const Layout& layout = kBlocks;
  static void unpack(const uint8_t* b, Weights& w) {
    nibble_blocks([b](int j) { return b + j * Bytes + 4; }, w.u);
    w.scale = halves8<Bytes>(b);
    w.constant = halves8<Bytes>(b + 2);
  }
};

struct Q5_0 : Traits {
  static constexpr int Elems = 32, Bytes = 22, MaxLevel = 31;
  static constexpr bool Offset = true;
  static constexpr const Layout& layout = kBlocks;
  static void unpack(const uint8_t* b, Weights& w) {
    nibble_blocks([b](int j) { return b + j * Bytes + 6; }, w.u);
    const __m256i qh = dwords8<Bytes>(b + 2);
    for (int v = 0; v < 8; ++v) w.u[v] = _mm256_or_si256(w.u[v], fifth_bits(qh, v));
    w.offset = _mm256_set1_epi16(16);
    w.scale = halves8<Bytes>(b);
  }
};

struct Q5_1 : Traits {
  static constexpr int Elems = 32, Bytes = 24, MaxLevel = 31;
  static constexpr bool Constant = true;
  static constexpr const Layout& layout = kBlocks;
  static void unpack(const uint8_t* b, Weights& w) {
    nibble_blocks([b](int j) { return b + j * Bytes + 8; }, w.u);
    const __m256i qh = dwords8<Bytes>(b + 4);
    for (int v = 0; v < 8; ++v) w.u[v] = _mm256_or_si256(w.u[v], fifth_bits(qh, v));
    w.scale = halves8<Bytes>(b);
    w.constant = halves8<Bytes>(b + 2);
  }
};

struct Q8_0 : Traits {
  static constexpr int Elems = 32, Bytes = 34, MaxLevel = 128;
  static constexpr bool Signed = true;
  static constexpr const Layout& layout = kBytes;
  static void unpack(const uint8_t* b, Weights& w) {
    for (int h = 0; h < 2; ++h) {
      __m256i t[4];
      for (int j = 0; j < 4; ++j) t[j] = load32(b + (4 * h + j) * Bytes + 2);
      transpose4(t[0], t[1], t[2], t[3]);
      for (int v = 0; v < 4; ++v) set_signed(w, 4 * h + v, t[v]);
    }
    w.scale = halves8<Bytes>(b);
  }
};

struct IQ4_NL : Traits {
  static constexpr int Elems = 32, Bytes = 18, MaxLevel = 128;
  static constexpr bool Signed = true;
  static constexpr const Layout& layout = kBlocks;
  static void unpack(const uint8_t* b, Weights& w) {
    __m256i t[8];
    nibble_blocks([b](int j) { return b + j * Bytes + 2; }, t);
    for (int v = 0; v < 8; ++v) set_signed(w, v, non_linear(t[v]));
    w.scale = halves8<Bytes>(b);
  }
};

struct Q2_K : Traits {  // scales[16] (low nibble: scale, high: min) | qs[64] | d | dmin
  static constexpr int Elems = 256, Bytes = 84, MaxLevel = 3;
  static constexpr bool SubScales = true, SubMins = true;
  static constexpr const Layout& layout = kPlanes;
  static void unpack(const uint8_t* b, Weights& w) {
    // block 4 part + shift: bits 2 shift of qs[32 part ..]; lanes 0-3: part 0 shift 0 and 1, part 1 shift 0 and 1
    __m256i z[4] = {load32(b + 16), load32(b + 16), load32(b + 48), load32(b + 48)};
    transpose4(z[0], z[1], z[2], z[3]);
    for (int v = 0; v < 4; ++v) {
      w.u[v] = _mm256_and_si256(shift_right(z[v], 0, 2, 0, 2), bytes(3));
      w.u[v + 4] = _mm256_and_si256(shift_right(z[v], 4, 6, 4, 6), bytes(3));
    }
    const __m128i scales = load16(b), low = _mm_set1_epi8(0x0f);
    w.sub[0] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_shuffle_epi8(scales, kPlanesLow), low));
    w.sub[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_shuffle_epi8(scales, kPlanesHigh), low));
    w.mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(_mm_shuffle_epi8(scales, planes_pairs()), 4), low));
    w.scale = _mm256_set1_ps(half(b + 80));
    w.constant = _mm256_set1_ps(-half(b + 82));
  }
};

struct Q3_K : Traits {  // hmask[32] | qs[64] | scales[12] | d
  static constexpr int Elems = 256, Bytes = 110, MaxLevel = 7;
  static constexpr bool SubScales = true, Offset = true;
  static constexpr const Layout& layout = kPlanes;
  static void unpack(const uint8_t* b, Weights& w) {
    const uint8_t* s = b + 96;
    const auto scale = [s](int j) {
      return int8_t((((s[j % 8] >> (4 * (j / 8))) & 0x0f) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
    };
    const __m128i scales = _mm_setr_epi8(scale(0), scale(1), scale(2), scale(3), scale(4), scale(5), scale(6), scale(7),
                                         scale(8), scale(9), scale(10), scale(11), scale(12), scale(13), scale(14), scale(15));
    // as Q2_K's levels, plus 4 where bit (block) of hmask is set, less 4
    __m256i z[4] = {load32(b + 32), load32(b + 32), load32(b + 64), load32(b + 64)};
    transpose4(z[0], z[1], z[2], z[3]);
    const __m256i hmask = load32(b);
    for (int v = 0; v < 4; ++v) {
      const __m256i h = spread_dword(hmask, v);
      const auto high = [&](int a, int b2, int c, int d) {
        return _mm256_and_si256(_mm256_slli_epi16(shift_right(h, a, b2, c, d), 2), bytes(4));
      };
      w.u[v] = _mm256_or_si256(_mm256_and_si256(shift_right(z[v], 0, 2, 0, 2), bytes(3)), high(0, 1, 4, 5));
      w.u[v + 4] = _mm256_or_si256(_mm256_and_si256(shift_right(z[v], 4, 6, 4, 6), bytes(3)), high(2, 3, 6, 7));
    }
    planes_scales(scales, 2, w);
    w.scale = _mm256_set1_ps(half(b + 108));
  }
};

struct Q4_K : Traits {  // d | dmin | scales[12] | qs[128]
  static constexpr int Elems = 256, Bytes = 144, MaxLevel = 15;
  static constexpr bool Constant = true;
  static constexpr const Layout& layout = kNibbles;
  static void unpack(const uint8_t* b, Weights& w) {
    // block 2c / 2c + 1: the low / high nibbles of qs[32 c ..]
    __m256i t[4] = {load32(b + 16), load32(b + 48), load32(b + 80), load32(b + 112)};
    transpose4(t[0], t[1], t[2], t[3]);
    for (int v = 0; v < 4; ++v) {
      w.u[v] = low_nibbles256(t[v]);
      w.u[v + 4] = high_nibbles256(t[v]);
    }
    k4_factors(b + 4, half(b), half(b + 2), w);
  }
};

struct Q5_K : Traits {  // d | dmin | scales[12] | qh[32] | qs[128]
  static constexpr int Elems = 256, Bytes = 176, MaxLevel = 31;
  static constexpr bool Constant = true;
  static constexpr const Layout& layout = kNibbles;
  static void unpack(const uint8_t* b, Weights& w) {
    // as Q4_K's levels, with bit (block) of qh as the fifth
    __m256i t[4] = {load32(b + 48), load32(b + 80), load32(b + 112), load32(b + 144)};
    transpose4(t[0], t[1], t[2], t[3]);
    const __m256i qh = load32(b + 16), fifth = bytes(0x10);
    for (int v = 0; v < 4; ++v) {
      const __m256i h = shift_right(spread_dword(qh, v), 0, 2, 4, 6);  // bit 2c (low) and 2c + 1 (high) at 0, 1
      w.u[v] = _mm256_or_si256(low_nibbles256(t[v]), _mm256_and_si256(_mm256_slli_epi16(h, 4), fifth));
      w.u[v + 4] = _mm256_or_si256(high_nibbles256(t[v]), _mm256_and_si256(_mm256_slli_epi16(h, 3), fifth));
    }
    k4_factors(b + 4, half(b), half(b + 2), w);
  }
};

struct Q6_K : Traits {  // ql[128] | qh[64] | scales[16] int8 | d
  static constexpr int Elems = 256, Bytes = 210, MaxLevel = 63;
  static constexpr bool SubScales = true, Offset = true;
  static constexpr const Layout& layout = kPlanes;
  static void unpack(const uint8_t* b, Weights& w) {
    // block 4 part + group: 4 bits of ql[64 part + 32 (group % 2) ..] (low nibble for groups 0, 1),
    // 2 of qh[32 part ..] (bits 2 group); lanes 0-3: part 0 groups 0 / 2, 1 / 3, part 1 likewise
    __m256i t[4] = {load32(b), load32(b + 32), load32(b + 64), load32(b + 96)};
    __m256i h[4] = {load32(b + 128), load32(b + 128), load32(b + 160), load32(b + 160)};
    transpose4(t[0], t[1], t[2], t[3]);
    transpose4(h[0], h[1], h[2], h[3]);
    const __m256i top = bytes(0x30);
    for (int v = 0; v < 4; ++v) {
      const __m256i low_high = _mm256_and_si256(_mm256_sllv_epi32(h[v], _mm256_setr_epi32(4, 2, 4, 2, 4, 2, 4, 2)), top);
      w.u[v] = _mm256_or_si256(low_nibbles256(t[v]), low_high);
      w.u[v + 4] = _mm256_or_si256(high_nibbles256(t[v]), _mm256_and_si256(shift_right(h[v], 0, 2, 0, 2), top));
    }
    planes_scales(load16(b + 192), 5, w);
    w.scale = _mm256_set1_ps(half(b + 208));
  }
};

struct IQ4_XS : Traits {  // d | scales_h (uint16) | scales_l[4] | qs[128]
  static constexpr int Elems = 256, Bytes = 136, MaxLevel = 128;
  static constexpr bool Signed = true;
  static constexpr const Layout& layout = kBlocks;
  static void unpack(const uint8_t* b, Weights& w) {
    __m256i t[8];
    nibble_blocks([b](int j) { return b + 8 + 16 * j; }, t);
    for (int v = 0; v < 8; ++v) set_signed(w, v, non_linear(t[v]));
    uint16_t scales_h;
    std::memcpy(&scales_h, b + 2, 2);
    const auto scale = [&](int i) { return (((b[4 + i / 2] >> (4 * (i % 2))) & 0x0f) | (((scales_h >> (2 * i)) & 3) << 4)) - 32; };
    const __m256i scales = _mm256_setr_epi32(scale(0), scale(1), scale(2), scale(3), scale(4), scale(5), scale(6), scale(7));
    w.scale = _mm256_mul_ps(_mm256_set1_ps(half(b)), _mm256_cvtepi32_ps(scales));
  }
};

// Chunk k (256 columns) of a row of K values. A 32-value format's partial last chunk is unpacked from
// a copy padded with zero blocks (zero factors and levels; x's levels there are zero too).
template <typename F>
inline void unpack_chunk(const uint8_t* row, int64_t K, int64_t k, Weights& w) {
  if constexpr (F::Elems == kChunk) {
    F::unpack(row + k * F::Bytes, w);
  } else {
    const int64_t first = kChunkBlocks * k, count = std::min<int64_t>(kChunkBlocks, K / kBlock - first);
    if (count == kChunkBlocks) {
      F::unpack(row + first * F::Bytes, w);
    } else {
      uint8_t padded[kChunkBlocks * F::Bytes] = {};
      std::memcpy(padded, row + first * F::Bytes, count * F::Bytes);
      F::unpack(padded, w);
    }
  }
  if constexpr (kSignFlip<F>) w.offset = _mm256_set1_epi16(128);
}

// x's levels r (vector v of a chunk) with the weights' signs where those are apart.
template <typename F>
inline __m256i signed_levels(const Weights& w, __m256i r, int v) {
  if constexpr (F::Signed && !kVnni) return _mm256_sign_epi8(r, w.q[v]);
  return r;
}

inline __m256i x_vector(const XChunk& x, int v) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(x.r[v])); }

// One chunk of a weight row by C rows of x (x[c * x_step]): half[h][c] = the lane sums of vectors
// 4h .. 4h + 3's byte products (times the 16-value scales where the format has them). Each weight
// vector serves the C rows; the integer sums are exact, so their order does not change them.
template <typename F, int C>
[[gnu::always_inline]] inline void half_dots(const Weights& w, const XChunk* x, int64_t x_step, __m256i (&half)[2][C]) {
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < C; ++c) half[h][c] = _mm256_setzero_si256();
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // dpbusd: each lane's 4 products summed straight into int32
#pragma GCC unroll 8
  for (int v = 0; v < 8; ++v)
    for (int c = 0; c < C; ++c) half[v / 4][c] = _mm256_dpbusd_epi32(half[v / 4][c], w.u[v], x_vector(x[c * x_step], v));
  if constexpr (F::SubScales) {
    // a lane's 4 values lie in one 16-value sub-block: its sum times the sub-block's scale (the lane's
    // two equal words of sub), below 2^31: 16 * 63 * 128 * 128. One multiply per lane, where madd of
    // the pair products takes one per vector.
    for (int h = 0; h < 2; ++h) {
      const __m256i scale = _mm256_srai_epi32(w.sub[h], 16);
      for (int c = 0; c < C; ++c) half[h][c] = _mm256_mullo_epi32(half[h][c], scale);
    }
  }
#else
  // maddubs: pairs of products in int16 (|pair| <= 2 * 63 * 128), `group` vectors summed there before
  // one madd: at most 4 * 2 * 31 * 128 or 2 * 2 * 63 * 128, below 2^15
  constexpr int group = F::MaxLevel <= 31 ? 4 : F::MaxLevel <= 63 ? 2 : 1;
#pragma GCC unroll 8
  for (int v = 0; v < 8; v += group) {
    const __m256i factor = F::SubScales ? w.sub[v / 4] : _mm256_set1_epi16(1);
    for (int c = 0; c < C; ++c) {
      __m256i pairs = _mm256_maddubs_epi16(w.u[v], signed_levels<F>(w, x_vector(x[c * x_step], v), v));
      for (int g = 1; g < group; ++g)
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w.u[v + g], signed_levels<F>(w, x_vector(x[c * x_step], v + g), v + g)));
      half[v / 4][c] = _mm256_add_epi32(half[v / 4][c], _mm256_madd_epi16(pairs, factor));
    }
  }
#endif
}

// A chunk's integer dot per block (lane L: block order[L]) from its two halves' lane sums.
template <typename F>
inline __m256i block_dots(__m256i a, __m256i b) {
  if constexpr (F::layout.halves)  // lanes 0-3: a's two 128-bit halves summed, lanes 4-7: b's
    return _mm256_add_epi32(_mm256_blend_epi32(a, b, 0xf0), _mm256_permute2x128_si256(a, b, 0x21));
  return _mm256_add_epi32(a, b);
}

// acc + a chunk's block dots of a weight row with one of x's: lane L takes its block's
// s_b * (a_b * dot) (+ c_b * s_b * sum(r_b)).
template <typename F>
inline __m256 chunk_sum(const Weights& w, const XChunk& x, __m256i dots, __m256 acc) {
  const __m256 vs = _mm256_load_ps(x.s);
  __m256i sums16;  // per block: a * sum(r, first 16) + b * sum(r, last 16) with madd
  if constexpr (kTakesSums<F>) sums16 = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.sum16));
  if constexpr (F::Offset || kSignFlip<F>) dots = _mm256_sub_epi32(dots, _mm256_madd_epi16(w.offset, sums16));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(w.scale, vs), acc);
  if constexpr (F::Constant) acc = _mm256_fmadd_ps(w.constant, _mm256_load_ps(x.sum), acc);
  if constexpr (F::SubMins) {
    const __m256i mins = _mm256_madd_epi16(w.mins, sums16);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(w.constant, vs), acc);
  }
  return acc;
}

// acc[c] + one chunk of a weight row dotted with C rows of x (x[c * x_step]).
template <typename F, int C>
[[gnu::always_inline]] inline void chunk_dots(const Weights& w, const XChunk* x, int64_t x_step, __m256 (&acc)[C]) {
  __m256i half[2][C];
  half_dots<F, C>(w, x, x_step, half);
  for (int c = 0; c < C; ++c) acc[c] = chunk_sum<F>(w, x[c * x_step], block_dots<F>(half[0][c], half[1][c]), acc[c]);
}

// The sum of a row's lanes, lane i holding the blocks i mod 8, summed in one fixed order.
template <typename F>
inline float finish(__m256 acc) {
  if constexpr (!natural(F::layout)) {
    alignas(32) int32_t inverse[8];
    for (int L = 0; L < 8; ++L) inverse[F::layout.order[L]] = L;
    acc = _mm256_permutevar8x32_ps(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(inverse)));
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row of x's levels (r), scales (s) and s * sum(levels) (sum) per block of 32, padded with zero
// blocks to whole chunks, laid out as F's weights into out [chunks].
template <typename F>
void lay_out(const int8_t* r, const float* s, const float* sum, int64_t chunks, XChunk* out) {
  for (int64_t k = 0; k < chunks; ++k) {
    XChunk& c = out[k];
    const int8_t* levels = r + k * kChunk;
    for (int v = 0; v < 8; ++v)
      for (int L = 0; L < 8; ++L) std::memcpy(c.r[v] + 4 * L, levels + 4 * F::layout.source[v][L], 4);
    for (int L = 0; L < 8; ++L) {
      const int block = F::layout.order[L];
      c.s[L] = s[k * kChunkBlocks + block];
      c.sum[L] = sum[k * kChunkBlocks + block];
      for (int h = 0; h < 2; ++h) {
        int total = 0;
        for (int i = 0; i < 16; ++i) total += levels[kBlock * block + 16 * h + i];
        c.sum16[2 * L + h] = int16_t(total);
      }
    }
  }
}

// x's rows rounded per block and laid out as F's weights, each padded with zero blocks to whole chunks,
// into out [M * chunks].
template <typename F>
void arrange(const float* x, int64_t M, int64_t K, XChunk* out) {
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  std::vector<int8_t> r(chunks * kChunk);
  std::vector<float> s(chunks * kChunkBlocks), sum(chunks * kChunkBlocks);
  for (int64_t m = 0; m < M; ++m) {
    quantize_blocks(x + m * K, K / kBlock, r.data(), s.data(), sum.data());  // the padding stays zero
    lay_out<F>(r.data(), s.data(), sum.data(), chunks, out + m * chunks);
  }
}

// x's rows as kLimbs rows each (block_limbs.h: row m's limbs are rows kLimbs * m .. kLimbs * m + 3, the
// most significant first), laid out as F's weights into out [kLimbs * M * chunks].
template <typename F>
void arrange_limbs(const float* x, int64_t M, int64_t K, XChunk* out) {
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  std::vector<int8_t> r(kLimbs * chunks * kChunk);
  std::vector<float> s(kLimbs * chunks * kChunkBlocks), sum(kLimbs * chunks * kChunkBlocks);
  int8_t* rl[kLimbs];
  float *sl[kLimbs], *suml[kLimbs];
  for (int l = 0; l < kLimbs; ++l) {
    rl[l] = r.data() + l * chunks * kChunk;
    sl[l] = s.data() + l * chunks * kChunkBlocks;
    suml[l] = sum.data() + l * chunks * kChunkBlocks;
  }
  for (int64_t m = 0; m < M; ++m) {
    limb_blocks(x + m * K, K / kBlock, rl, sl, suml);  // the padding stays zero
    for (int l = 0; l < kLimbs; ++l) lay_out<F>(rl[l], sl[l], suml[l], chunks, out + (kLimbs * m + l) * chunks);
  }
}

// Weight rows [begin, end) dotted with C rows of x (x: their chunks, row after row), each chunk
// unpacked once for the C rows.
template <typename F, int C>
void fused_rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t chunks, int64_t begin, int64_t end,
                const XChunk* x, int64_t N, float* out) {
  for (int64_t n = begin; n < end; ++n) {
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < chunks; ++k) {
      Weights chunk;
      unpack_chunk<F>(w + n * row_bytes, K, k, chunk);
      chunk_dots<F, C>(chunk, x + k, chunks, acc);
    }
    for (int c = 0; c < C; ++c) out[c * N + n] = finish<F>(acc[c]);
  }
}

// `rows` unpacked weight rows (row n0 on) dotted with C rows of x.
template <typename F, int C>
void tile_rows(const Weights* unpacked, int64_t rows, int64_t chunks, int64_t n0, const XChunk* x, int64_t N, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < chunks; ++k) chunk_dots<F, C>(unpacked[r * chunks + k], x + k, chunks, acc);
    for (int c = 0; c < C; ++c) out[c * N + n0 + r] = finish<F>(acc[c]);
  }
}

// out[m * N + n] = weight row n . x's row m for n in [begin, end) and the M rows of x (arranged):
// up to kTileRows rows, each weight chunk unpacked once for all of them; more, kRowBlock rows unpacked
// into a buffer and dotted with the rows of x kTileRows at a time.
template <typename F>
void rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t begin, int64_t end, const XChunk* x, int64_t M,
          int64_t N, float* out) {
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  switch (M) {
    case 1: return fused_rows<F, 1>(w, row_bytes, K, chunks, begin, end, x, N, out);
    case 2: return fused_rows<F, 2>(w, row_bytes, K, chunks, begin, end, x, N, out);
    case 3: return fused_rows<F, 3>(w, row_bytes, K, chunks, begin, end, x, N, out);
    case 4: return fused_rows<F, 4>(w, row_bytes, K, chunks, begin, end, x, N, out);
    default: break;
  }
  const std::unique_ptr<Weights[]> unpacked(new Weights[kRowBlock * chunks]);  // written before it is read
  for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
    const int64_t count = std::min<int64_t>(kRowBlock, end - n0);
    for (int64_t r = 0; r < count; ++r)
      for (int64_t k = 0; k < chunks; ++k) unpack_chunk<F>(w + (n0 + r) * row_bytes, K, k, unpacked[r * chunks + k]);
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const XChunk* xm = x + m0 * chunks;
      float* om = out + m0 * N;
      switch (std::min<int64_t>(kTileRows, M - m0)) {
        case 1: tile_rows<F, 1>(unpacked.get(), count, chunks, n0, xm, N, om); break;
        case 2: tile_rows<F, 2>(unpacked.get(), count, chunks, n0, xm, N, om); break;
        case 3: tile_rows<F, 3>(unpacked.get(), count, chunks, n0, xm, N, om); break;
        default: tile_rows<F, 4>(unpacked.get(), count, chunks, n0, xm, N, om); break;
      }
    }
  }
}

// The fewest weight rows a task of rows() takes for M rows of x: up to kTileRows rows, >= ~64 K
// multiply-adds; more, whole row blocks.
inline int64_t task_rows(int64_t M, int64_t K) {
  return M <= kTileRows ? std::max<int64_t>(1, (1 << 16) / (K * M)) : kRowBlock;
}

template <typename F>
void matmul(const float* xf, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t K, int64_t N, float* out) {
  std::vector<XChunk> x(M * ((K + kChunk - 1) / kChunk));
  arrange<F>(xf, M, K, x.data());
  for_each_range(N, task_rows(M, K), [&](int64_t begin, int64_t end) { rows<F>(w, row_bytes, K, begin, end, x.data(), M, N, out); });
}

// 8 outputs' limb dots (limb l at d + l * stride), summed the most significant first. Not inlined:
// every output takes this one instruction sequence, so no reassociation the compiler may choose
// (-fassociative-math) can give an output other bits in a call whose ranges fall otherwise.
__attribute__((noinline)) void sum_limbs8(const float* d, int64_t stride, float* out) {
  __m256 sum = _mm256_loadu_ps(d);
  for (int l = 1; l < kLimbs; ++l) sum = _mm256_add_ps(sum, _mm256_loadu_ps(d + l * stride));
  _mm256_storeu_ps(out, sum);
}

// out[n] for n in [begin, end): the sum of one row of x's limb dots (d: kLimbs rows of N).
inline void add_limbs(const float* d, int64_t N, int64_t begin, int64_t end, float* out) {
  int64_t n = begin;
  for (; n + 8 <= end; n += 8) sum_limbs8(d + n, N, out + n);
  if (n == end) return;
  float tail[kLimbs][8] = {}, sums[8];
  for (int l = 0; l < kLimbs; ++l) std::memcpy(tail[l], d + l * N + n, (end - n) * sizeof(float));
  sum_limbs8(tail[0], 8, sums);
  std::memcpy(out + n, sums, (end - n) * sizeof(float));
}

// x @ W^T with x's rows as limbs (arrange_limbs): the kLimbs rows of each row of x dotted as the
// rows above, then each output the sum of its limbs' dots, the most significant first.
template <typename F>
void limb_matmul(const float* xf, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t K, int64_t N, float* out) {
  const int64_t limb_rows = kLimbs * M;
  std::vector<XChunk> x(limb_rows * ((K + kChunk - 1) / kChunk));
  arrange_limbs<F>(xf, M, K, x.data());
  const std::unique_ptr<float[]> dots(new float[limb_rows * N]);  // each written before it is read
  for_each_range(N, task_rows(limb_rows, K), [&](int64_t begin, int64_t end) {
    rows<F>(w, row_bytes, K, begin, end, x.data(), limb_rows, N, dots.get());
    for (int64_t m = 0; m < M; ++m) add_limbs(dots.get() + kLimbs * m * N, N, begin, end, out + m * N);
  });
}

// x [M, K] float32 -> uint8 [M, chunks * sizeof(XChunk)]: its rows arranged for F (at::empty's storage is
// aligned past XChunk's 32 bytes, and sizeof(XChunk) is a multiple of them)
template <typename F>
at::Tensor arranged_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % kBlock == 0,
              "gguf_int8_kernel: x must be contiguous float32 [M, K], K a multiple of 32");
  static_assert(sizeof(XChunk) % 32 == 0, "arranged rows keep XChunk's alignment");
  const int64_t M = x.size(0), K = x.size(1), chunks = (K + kChunk - 1) / kChunk;
  auto out = at::empty({M, chunks * static_cast<int64_t>(sizeof(XChunk))}, x.options().dtype(at::kByte));
  arrange<F>(x.data_ptr<float>(), M, K, reinterpret_cast<XChunk*>(out.data_ptr<uint8_t>()));
  return out;
}

template <typename F>
void arranged_dot(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t begin, int64_t end, const uint8_t* x,
                  int64_t M, int64_t N, float* out) {
  rows<F>(w, row_bytes, K, begin, end, reinterpret_cast<const XChunk*>(x), M, N, out);
}

struct Format {
  int64_t elems, bytes;
  void (*matmul)(const float*, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*);
  void (*limb_matmul)(const float*, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*);
  GgufInt8Kernel kernel;
};

template <typename F>
constexpr Format format_of() {
  return {F::Elems, F::Bytes, &matmul<F>, &limb_matmul<F>, {&F::layout, F::Elems, F::Bytes, &arranged_rows<F>, &arranged_dot<F>}};
}

Format format_named(const std::string& name) {
  return gguf_format_named<Format, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS>(
      name, "gguf_matmul_int8", [](auto tag) { return format_of<typename decltype(tag)::type>(); });
}

// x @ W^T for the entry point `name`, after checking x and raw against `format`: Format::matmul (x
// rounded to int8) or Format::limb_matmul (x as limbs).
template <auto Kernel>
at::Tensor checked_matmul(const char* name, at::Tensor x, const at::Tensor& raw, const std::string& format) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, name, ": x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = raw.size(0);
  const Format f = format_named(format);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.stride(1) == 1 && raw.stride(0) == raw.size(1),
              name, ": raw must be contiguous uint8 [rows, row bytes]");
  TORCH_CHECK(K > 0 && K % f.elems == 0 && raw.size(1) == K / f.elems * f.bytes, name, ": ", format,
              " rows of ", K, " values take ", K / f.elems * f.bytes, " bytes (", f.elems, " per ", f.bytes,
              "-byte block), not ", raw.size(1));
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  (f.*Kernel)(x.data_ptr<float>(), raw.data_ptr<uint8_t>(), raw.size(1), M, K, N, out.data_ptr<float>());
  return out;
}

}  // namespace

at::Tensor gguf_matmul_int8(at::Tensor x, at::Tensor raw, const std::string& format) {
  return checked_matmul<&Format::matmul>("gguf_matmul_int8", std::move(x), raw, format);
}

at::Tensor gguf_matmul_limbs(at::Tensor x, at::Tensor raw, const std::string& format) {
  return checked_matmul<&Format::limb_matmul>("gguf_matmul_limbs", std::move(x), raw, format);
}

GgufInt8Kernel gguf_int8_kernel(const std::string& format) { return format_named(format).kernel; }

}  // namespace blockserve
