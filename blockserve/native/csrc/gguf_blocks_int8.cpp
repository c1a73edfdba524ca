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
//
// Where a format's sub-block scales cover 16 values (Q2_K, Q3_K, Q6_K), they are integers folded into
// the integer sum (the pair products multiplied by them in madd). Levels stored with an offset
// (Q4_0: q - 8, Q5_0: q - 16, Q3_K: q - 4, Q6_K: q - 32) multiply as the unsigned q, the offset
// (times the sub-block scale) times the sum of x's levels per 16 values taken off in integers; Q2_K's
// 16-value mins take those sums too. Other signed levels (Q8_0, IQ4_NL, IQ4_XS) multiply as |q| times
// x's levels with q's sign (u8 x s8 products). Every integer sum is exact; a block's sum is
// converted to float32 once (exact below 2^24 and within one rounding above).
//
// Per output row the blocks are first unpacked into chunks of 256 columns (the levels as bytes, the
// factors as floats: one K-quant super-block, or eight 32-value blocks), kept in L1 while every row
// of x is dotted with them: each weight is unpacked once per call, and each output is one running
// sum over K in a fixed order, so a row's result is the same bits whatever else shares its call.
// Both builds run the same 256-bit loop; AVX-512 VNNI builds multiply-add bytes with dpbusd, AVX2
// with maddubs + madd (no pair of products leaves int16: |q| <= 128 and |r| <= 127).

#include "kernels.h"

#include "block_levels.h"
#include "block_unpack.h"
#include "task_pool.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace blockserve {
namespace {

constexpr int kBlock = 32;        // values per block of x's levels
constexpr int kChunkBlocks = 8;   // blocks of 32 per chunk
constexpr int kChunk = kBlock * kChunkBlocks;

// One output row's weights over 256 columns as the dot products take them.
struct alignas(32) Chunk {
  uint8_t u[kChunk];              // unsigned levels (|q| where the format's levels are signed)
  int8_t q[kChunk];               // signed formats: the levels, whose signs move onto x's
  int16_t sub[kChunkBlocks][16];  // 16-value sub-blocks: the integer scale of each pair product
                                  // (words 0-7: the block's first 16 values, 8-15: the rest)
  int16_t offset[2 * kChunkBlocks];  // offset formats: each 16 values' offset times their sub-block scale
  int16_t mins[2 * kChunkBlocks]; // Q2_K: each 16-value sub-block's integer min
  float scale[kChunkBlocks];      // a_b: each block's factor of its integer dot
  float constant[kChunkBlocks];   // c_b: each block's factor of s_b * sum(r_b) (Q2_K: of s_b * the mins' dot)
};

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // exact, subnormals included
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i pair(__m128i low, __m128i high) { return _mm256_set_m128i(high, low); }
inline __m256i low_nibbles256(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
inline __m256i high_nibbles256(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
// bits 2 shift and 2 shift + 1 of every byte
inline __m256i two_bits(__m256i v, int shift) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * shift)), _mm256_set1_epi8(3));
}
// 0xff in every byte of v where `bit` is set
inline __m256i has_bit(__m256i v, int bit) {
  const __m256i mask = _mm256_set1_epi8(char(1 << bit));
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
}

inline void store_unsigned(Chunk& c, int i, __m256i u) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(c.u + kBlock * i), u);
}
inline void store_signed(Chunk& c, int i, __m256i q) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(c.q + kBlock * i), q);
  store_unsigned(c, i, _mm256_sign_epi8(q, q));
}
inline void store_sub_scales(Chunk& c, int i, int first, int second) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(c.sub[i]),
                     pair(_mm_set1_epi16(int16_t(first)), _mm_set1_epi16(int16_t(second))));
}

// Q4_K and Q5_K's eight 6-bit scales and mins packed in 12 bytes (gguf_blocks.cpp's layout).
inline void scale_min_k4(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

constexpr int8_t kNonLinear4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
inline __m128i non_linear(__m128i nibbles) {
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kNonLinear4)), nibbles);
}

// Each format: Elems values in Bytes per block; unpack_block writes the block at `b` into chunk
// `c` from block `i` of 32 values on (a 32-value format: block i; a super-block: blocks 0-7).
// Signed: levels of either sign (q); SubScales: 16-value integer scales (sub); Offset: levels
// stored as q + offset (offset); Constant: a constant term (c_b); SubMins: Q2_K's 16-value mins.
struct Traits {
  static constexpr bool Signed = false, SubScales = false, Offset = false, Constant = false, SubMins = false;
};

inline void store_offsets(Chunk& c, int i, int first, int second) {
  c.offset[2 * i] = int16_t(first);
  c.offset[2 * i + 1] = int16_t(second);
}

struct Q4_0 : Traits {
  static constexpr int Elems = 32, Bytes = 18;
  static constexpr bool Offset = true;
  static void unpack_block(const uint8_t* b, int i, Chunk& c) {
    const __m128i qs = load16(b + 2);
    store_unsigned(c, i, pair(low_nibbles(qs), high_nibbles(qs)));
    store_offsets(c, i, 8, 8);
    c.scale[i] = half(b);
  }
};

struct Q4_1 : Traits {
  static constexpr int Elems = 32, Bytes = 20;
  static constexpr bool Constant = true;
  static void unpack_block(const uint8_t* b, int i, Chunk& c) {
    const __m128i qs = load16(b + 4);
    store_unsigned(c, i, pair(low_nibbles(qs), high_nibbles(qs)));
    c.scale[i] = half(b);
    c.constant[i] = half(b + 2);
  }
};

struct Q8_0 : Traits {
  static constexpr int Elems = 32, Bytes = 34;
  static constexpr bool Signed = true;
  static void unpack_block(const uint8_t* b, int i, Chunk& c) {
    store_signed(c, i, load32(b + 2));
    c.scale[i] = half(b);
  }
};

// Q5_0 / Q5_1's 32 levels: the nibbles of qs with bit j of qh as level j's fifth bit
inline __m256i five_bits(const uint8_t* qh, const uint8_t* qs) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m128i q = load16(qs), fifth = _mm_set1_epi8(0x10);
  return pair(_mm_or_si128(low_nibbles(q), _mm_and_si128(bit_bytes(h), fifth)),
              _mm_or_si128(high_nibbles(q), _mm_and_si128(bit_bytes(h >> 16), fifth)));
}

struct Q5_0 : Traits {
  static constexpr int Elems = 32, Bytes = 22;
  static constexpr bool Offset = true;
  static void unpack_block(const uint8_t* b, int i, Chunk& c) {
    store_unsigned(c, i, five_bits(b + 2, b + 6));
    store_offsets(c, i, 16, 16);
    c.scale[i] = half(b);
  }
};

struct Q5_1 : Traits {
  static constexpr int Elems = 32, Bytes = 24;
  static constexpr bool Constant = true;
  static void unpack_block(const uint8_t* b, int i, Chunk& c) {
    store_unsigned(c, i, five_bits(b + 4, b + 8));
    c.scale[i] = half(b);
    c.constant[i] = half(b + 2);
  }
};

struct IQ4_NL : Traits {
  static constexpr int Elems = 32, Bytes = 18;
  static constexpr bool Signed = true;
  static void unpack_block(const uint8_t* b, int i, Chunk& c) {
    const __m128i qs = load16(b + 2);
    store_signed(c, i, pair(non_linear(low_nibbles(qs)), non_linear(high_nibbles(qs))));
    c.scale[i] = half(b);
  }
};

struct Q2_K : Traits {  // scales[16] (low nibble: scale, high: min) | qs[64] | d | dmin
  static constexpr int Elems = 256, Bytes = 84;
  static constexpr bool SubScales = true, SubMins = true;
  static void unpack_block(const uint8_t* b, int, Chunk& c) {
    const uint8_t* scales = b;
    const float d = half(b + 80), dmin = half(b + 82);
    for (int part = 0; part < 2; ++part) {
      const __m256i qs = load32(b + 16 + 32 * part);
      for (int shift = 0; shift < 4; ++shift) {  // block i: bits 2 shift of the half's 32 bytes
        const int i = 4 * part + shift;
        store_unsigned(c, i, two_bits(qs, shift));
        store_sub_scales(c, i, scales[2 * i] & 0x0f, scales[2 * i + 1] & 0x0f);
        c.scale[i] = d;
        c.constant[i] = -dmin;
      }
    }
    for (int j = 0; j < 16; ++j) c.mins[j] = int16_t(scales[j] >> 4);
  }
};

struct Q3_K : Traits {  // hmask[32] | qs[64] | scales[12] | d
  static constexpr int Elems = 256, Bytes = 110;
  static constexpr bool SubScales = true, Offset = true;
  static void unpack_block(const uint8_t* b, int, Chunk& c) {
    const uint8_t* s = b + 96;
    const float d = half(b + 108);
    int scales[16];
    for (int j = 0; j < 16; ++j)
      scales[j] = (((s[j % 8] >> (4 * (j / 8))) & 0x0f) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
    const __m256i hmask = load32(b), four = _mm256_set1_epi8(4);
    for (int part = 0; part < 2; ++part) {
      const __m256i qs = load32(b + 32 + 32 * part);
      for (int shift = 0; shift < 4; ++shift) {  // block i: 2 bits of qs, plus 4 where bit i of hmask is set, less 4
        const int i = 4 * part + shift;
        store_unsigned(c, i, _mm256_or_si256(two_bits(qs, shift), _mm256_and_si256(has_bit(hmask, i), four)));
        store_sub_scales(c, i, scales[2 * i], scales[2 * i + 1]);
        store_offsets(c, i, 4 * scales[2 * i], 4 * scales[2 * i + 1]);
        c.scale[i] = d;
      }
    }
  }
};

struct Q4_K : Traits {  // d | dmin | scales[12] | qs[128]
  static constexpr int Elems = 256, Bytes = 144;
  static constexpr bool Constant = true;
  static void unpack_block(const uint8_t* b, int, Chunk& c) {
    const float d = half(b), dmin = half(b + 2);
    for (int chunk = 0; chunk < 4; ++chunk) {  // 64 weights: the low nibbles of 32 bytes, then the high
      const __m256i q = load32(b + 16 + 32 * chunk);
      store_unsigned(c, 2 * chunk, low_nibbles256(q));
      store_unsigned(c, 2 * chunk + 1, high_nibbles256(q));
    }
    for (int i = 0; i < 8; ++i) {
      int sc, m;
      scale_min_k4(b + 4, i, &sc, &m);
      c.scale[i] = d * float(sc);  // exact, as gguf-py's product
      c.constant[i] = -(dmin * float(m));
    }
  }
};

struct Q5_K : Traits {  // d | dmin | scales[12] | qh[32] | qs[128]
  static constexpr int Elems = 256, Bytes = 176;
  static constexpr bool Constant = true;
  static void unpack_block(const uint8_t* b, int, Chunk& c) {
    const float d = half(b), dmin = half(b + 2);
    const __m256i qh = load32(b + 16), fifth = _mm256_set1_epi8(0x10);
    for (int i = 0; i < 8; ++i) {  // block i: nibbles of qs (low for even i, high for odd), bit i of qh
      const __m256i q = load32(b + 48 + 32 * (i / 2));
      const __m256i high = _mm256_and_si256(has_bit(qh, i), fifth);
      store_unsigned(c, i, _mm256_or_si256(i % 2 ? high_nibbles256(q) : low_nibbles256(q), high));
      int sc, m;
      scale_min_k4(b + 4, i, &sc, &m);
      c.scale[i] = d * float(sc);
      c.constant[i] = -(dmin * float(m));
    }
  }
};

struct Q6_K : Traits {  // ql[128] | qh[64] | scales[16] int8 | d
  static constexpr int Elems = 256, Bytes = 210;
  static constexpr bool SubScales = true, Offset = true;
  static void unpack_block(const uint8_t* b, int, Chunk& c) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int part = 0; part < 2; ++part) {
      const __m256i qh = load32(b + 128 + 32 * part);
      for (int group = 0; group < 4; ++group) {  // block i: 4 bits of ql, 2 of qh (less 32)
        const int i = 4 * part + group;
        const __m256i ql = load32(b + 64 * part + 32 * (group % 2));
        const __m256i low = group / 2 ? high_nibbles256(ql) : low_nibbles256(ql);
        const __m256i level = _mm256_or_si256(low, _mm256_slli_epi16(two_bits(qh, group), 4));
        store_unsigned(c, i, level);
        store_sub_scales(c, i, scales[2 * i], scales[2 * i + 1]);
        store_offsets(c, i, 32 * scales[2 * i], 32 * scales[2 * i + 1]);
        c.scale[i] = d;
      }
    }
  }
};

struct IQ4_XS : Traits {  // d | scales_h (uint16) | scales_l[4] | qs[128]
  static constexpr int Elems = 256, Bytes = 136;
  static constexpr bool Signed = true;
  static void unpack_block(const uint8_t* b, int, Chunk& c) {
    const float d = half(b);
    uint16_t scales_h;
    std::memcpy(&scales_h, b + 2, 2);
    for (int i = 0; i < 8; ++i) {
      const int scale = (((b[4 + i / 2] >> (4 * (i % 2))) & 0x0f) | (((scales_h >> (2 * i)) & 3) << 4)) - 32;
      const __m128i q = load16(b + 8 + 16 * i);
      store_signed(c, i, pair(non_linear(low_nibbles(q)), non_linear(high_nibbles(q))));
      c.scale[i] = d * float(scale);
    }
  }
};

// A row of K values (K a multiple of F::Elems) as chunks. A 32-value format's partial last chunk
// has zero factors past K (its levels there are not read).
template <typename F>
void unpack_row(const uint8_t* row, int64_t K, Chunk* chunks) {
  constexpr int kPerChunk = kChunk / F::Elems;  // blocks per chunk
  const int64_t blocks = K / F::Elems;
  for (int64_t b = 0; b < blocks; ++b) F::unpack_block(row + b * F::Bytes, int(b % kPerChunk), chunks[b / kPerChunk]);
  if (const int filled = int(K % kChunk / kBlock)) {
    Chunk& last = chunks[K / kChunk];
    std::fill(last.scale + filled, last.scale + kChunkBlocks, 0.f);
    std::fill(last.constant + filled, last.constant + kChunkBlocks, 0.f);
    std::fill(last.offset + 2 * filled, last.offset + 2 * kChunkBlocks, int16_t(0));
  }
}

// x's rows rounded per block, each padded with zero blocks to whole chunks.
struct Levels {
  int64_t blocks;               // per row (a multiple of 8)
  std::vector<int8_t> r;        // [M, blocks * 32]
  std::vector<float> s, sum;    // [M, blocks]: s_b and s_b * sum(r_b)
  std::vector<int16_t> sum16;   // [M, 2 * blocks]: the sums of each 16 levels (offsets, Q2_K's mins)
};

Levels rounded(const float* x, int64_t M, int64_t K, bool sums_of_16) {
  const int64_t blocks = (K + kChunk - 1) / kChunk * kChunkBlocks;
  Levels l{blocks, std::vector<int8_t>(M * blocks * kBlock), std::vector<float>(M * blocks),
           std::vector<float>(M * blocks), std::vector<int16_t>(sums_of_16 ? 2 * M * blocks : 0)};
  for (int64_t m = 0; m < M; ++m)
    quantize_blocks(x + m * K, K / kBlock, l.r.data() + m * blocks * kBlock, l.s.data() + m * blocks,
                    l.sum.data() + m * blocks);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (size_t b = 0; b < l.sum16.size() / 2; ++b) {  // sad: sums of 8 bytes, of r + 128
    const __m256i eights = _mm256_sad_epu8(_mm256_xor_si256(load32(reinterpret_cast<const uint8_t*>(l.r.data()) + kBlock * b), flip),
                                           _mm256_setzero_si256());
    l.sum16[2 * b] = int16_t(_mm256_extract_epi64(eights, 0) + _mm256_extract_epi64(eights, 1) - 16 * 128);
    l.sum16[2 * b + 1] = int16_t(_mm256_extract_epi64(eights, 2) + _mm256_extract_epi64(eights, 3) - 16 * 128);
  }
  return l;
}

// Eight int32 lanes summing to u . v plus acc's lanes (u unsigned, v signed bytes).
inline __m256i dot_u8s8(__m256i u, __m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

// Lane i: the sum of p[i]'s eight lanes.
inline __m256i sum_each(const __m256i p[kChunkBlocks]) {
  // hadd twice: [p0 p1 p2 p3 | p0 p1 p2 p3], each the sum of the 128-bit half's four lanes
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc + a chunk dotted with x's levels r (scales s, level sums sum and sum16) over its first n blocks.
template <typename F>
inline __m256 chunk_dot(const Chunk& c, const int8_t* r, const float* s, const float* sum, const int16_t* sum16,
                        int n, __m256 acc) {
  __m256i p[kChunkBlocks];
  for (int i = 0; i < kChunkBlocks; ++i) {
    if (i >= n) {
      p[i] = _mm256_setzero_si256();
      continue;
    }
    const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(c.u + kBlock * i));
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + kBlock * i));
    if constexpr (F::Signed) v = _mm256_sign_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(c.q + kBlock * i)));
    if constexpr (F::SubScales)
      p[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_load_si256(reinterpret_cast<const __m256i*>(c.sub[i])));
    else
      p[i] = dot_u8s8(u, v);
  }
  const __m256 vs = _mm256_loadu_ps(s);
  __m256i dots = sum_each(p);
  __m256i sums16;  // per block: a * sum(r, first 16) + b * sum(r, last 16) with madd
  if constexpr (F::Offset || F::SubMins) sums16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sum16));
  if constexpr (F::Offset)
    dots = _mm256_sub_epi32(dots, _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(c.offset)), sums16));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(_mm256_load_ps(c.scale), vs), acc);
  if constexpr (F::Constant) acc = _mm256_fmadd_ps(_mm256_load_ps(c.constant), _mm256_loadu_ps(sum), acc);
  if constexpr (F::SubMins) {
    const __m256i mins = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(c.mins)), sums16);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(_mm256_load_ps(c.constant), vs), acc);
  }
  return acc;
}

// One output row (its chunks, the last `tail` blocks long: 0 for whole) dotted with row m of x.
template <typename F>
float row_dot(const Chunk* chunks, int64_t count, int tail, const Levels& l, int64_t m) {
  const int8_t* r = l.r.data() + m * l.blocks * kBlock;
  const float* s = l.s.data() + m * l.blocks;
  const float* sum = l.sum.data() + m * l.blocks;
  const int16_t* sum16 = F::Offset || F::SubMins ? l.sum16.data() + 2 * m * l.blocks : nullptr;
  const int64_t whole = tail ? count - 1 : count;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < whole; ++k)
    acc = chunk_dot<F>(chunks[k], r + kChunk * k, s + kChunkBlocks * k, sum + kChunkBlocks * k,
                       sum16 ? sum16 + 2 * kChunkBlocks * k : nullptr, kChunkBlocks, acc);
  if (tail)
    acc = chunk_dot<F>(chunks[whole], r + kChunk * whole, s + kChunkBlocks * whole, sum + kChunkBlocks * whole,
                       sum16 ? sum16 + 2 * kChunkBlocks * whole : nullptr, tail, acc);
  return sum_lanes(acc);
}

template <typename F>
void matmul(const Levels& l, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t K, int64_t N, float* out) {
  const int64_t count = (K + kChunk - 1) / kChunk;
  const int tail = int(K % kChunk / kBlock);
  // tasks of >= ~64 K multiply-adds
  for_each_range(N, std::max<int64_t>(1, (1 << 16) / (K * M)), [&](int64_t begin, int64_t end) {
    std::vector<Chunk> chunks(count);
    for (int64_t n = begin; n < end; ++n) {
      unpack_row<F>(w + n * row_bytes, K, chunks.data());
      for (int64_t m = 0; m < M; ++m) out[m * N + n] = row_dot<F>(chunks.data(), count, tail, l, m);
    }
  });
}

struct Format {
  int64_t elems, bytes;
  bool sums_of_16;
  void (*matmul)(const Levels&, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*);
};

template <typename F>
constexpr Format format_of() {
  return {F::Elems, F::Bytes, F::Offset || F::SubMins, &matmul<F>};
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
  TORCH_CHECK(false, "gguf_matmul_int8: no kernel for GGUF format ", name,
              " (read: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)");
}

}  // namespace

at::Tensor gguf_matmul_int8(at::Tensor x, at::Tensor raw, const std::string& format) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_matmul_int8: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = raw.size(0);
  const Format f = format_named(format);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.stride(1) == 1 && raw.stride(0) == raw.size(1),
              "gguf_matmul_int8: raw must be contiguous uint8 [rows, row bytes]");
  TORCH_CHECK(K > 0 && K % f.elems == 0 && raw.size(1) == K / f.elems * f.bytes, "gguf_matmul_int8: ", format,
              " rows of ", K, " values take ", K / f.elems * f.bytes, " bytes (", f.elems, " per ", f.bytes,
              "-byte block), not ", raw.size(1));
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Levels l = rounded(x.data_ptr<float>(), M, K, f.sums_of_16);
  f.matmul(l, raw.data_ptr<uint8_t>(), raw.size(1), M, K, N, out.data_ptr<float>());
  return out;
}

}  // namespace blockserve
