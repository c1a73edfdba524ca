// MXFP4 weights (OCP microscaling: gpt-oss's experts) read in place, in the Hugging Face
// checkpoint's layout, never widened whole:
//
//   blocks uint8 [N, K/32, 16]   32 e2m1 values per block, two a byte, the low nibble first
//   scales uint8 [N, K/32]       one e8m0 exponent per block: the block's values times 2^(s - 127)
//
//   mxfp4_matmul(x [M, K] float32, blocks, scales) -> out [M, N] = x @ W^T, W [N, K]:
//       x's columns are first reordered within each block of 32 (the even ones, then the odd ones),
//       so a byte's two nibbles land 16 apart; each output row is then dequantised once, in that
//       order, into a per-task buffer of K floats (L1/L2) and dotted with the M reordered rows
//       (row_dot.h). The weights are read from memory at their file size. From kTileRows rows
//       of x on, tiles of kTile output rows are dequantised instead and multiplied by ATen's
//       matmul (its blocked GEMM beats one row at a time once the weights are reused that often).
//
// Dequantising: the e2m1 table is one register. AVX-512: 16 nibbles widened to int32 index it with
// vpermps; AVX2: 8 at a time, the magnitude from an 8-entry table and the sign from the nibble's
// top bit; otherwise a scalar table lookup. Every dequantised value (an e2m1 value times a power of
// two) is exact in float32, so the result is a float32 matmul over transformers' dequantised
// weights up to the order of the sums. The work runs on the process's TaskPool over ranges of
// output rows.

#include "kernels.h"

#include "row_dot.h"
#include "task_pool.h"

#include <algorithm>
#include <cmath>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <vector>

namespace blockserve {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileRows = 16;  // rows of x from which the tiled path runs (measured: benchmarks/mxfp4_matmul.py)
constexpr int64_t kTile = 256;     // output rows dequantised per tile
constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float e8m0(uint8_t s) { return s == 255 ? NAN : std::ldexp(1.0f, int(s) - 127); }

// One row's blocks as floats, each block's low nibbles (its even columns) then its high ones.
void dequantize_row(const uint8_t* blocks, const uint8_t* scales, int64_t groups, float* out) {
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512i low = _mm512_set1_epi32(0x0f);
#elif defined(__AVX2__)
  const __m256 magnitudes = _mm256_loadu_ps(kE2M1);
  const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8), low = _mm256_set1_epi32(0x0f);
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const float d = e8m0(scales[g]);
    const uint8_t* q = blocks + g * (kBlock / 2);
    float* y = out + g * kBlock;
#if defined(__AVX512F__)
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512 scale = _mm512_set1_ps(d);
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(bytes, low), table), scale));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table), scale));
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(d);
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * half)));
      const __m256i nibbles[2] = {_mm256_and_si256(bytes, low), _mm256_srli_epi32(bytes, 4)};
      for (int hi = 0; hi < 2; ++hi) {
        const __m256 magnitude = _mm256_permutevar8x32_ps(magnitudes, _mm256_and_si256(nibbles[hi], seven));
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(nibbles[hi], eight), 28));
        _mm256_storeu_ps(y + 16 * hi + 8 * half, _mm256_mul_ps(_mm256_xor_ps(magnitude, sign), scale));
      }
    }
#else
    for (int j = 0; j < kBlock / 2; ++j) {
      y[j] = kE2M1[q[j] & 0x0f] * d;
      y[j + kBlock / 2] = kE2M1[q[j] >> 4] * d;
    }
#endif
  }
}

// x [M, K] with each block of 32 columns as dequantize_row orders the weights: even, then odd.
at::Tensor split_even_odd(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  return x.view({M, K / kBlock, kBlock / 2, 2}).transpose(2, 3).contiguous().view({M, K});
}

}  // namespace

at::Tensor mxfp4_matmul(at::Tensor x, at::Tensor blocks, at::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "mxfp4_matmul: x must be float32 [M, K]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == kBlock / 2 &&
                  blocks.is_contiguous(),
              "mxfp4_matmul: blocks must be contiguous uint8 [N, K/32, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(0) == blocks.size(0) && scales.size(1) == blocks.size(1),
              "mxfp4_matmul: scales must be contiguous uint8 [N, K/32], as blocks' first two dimensions");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), groups = blocks.size(1);
  TORCH_CHECK(K == groups * kBlock, "mxfp4_matmul: x has ", K, " columns but the blocks hold ", groups * kBlock);
  x = split_even_odd(x.contiguous());
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const uint8_t* s = scales.data_ptr<uint8_t>();
  if (M >= kTileRows) {
    auto tile = at::empty({std::min(kTile, N), K}, x.options());
    float* t = tile.data_ptr<float>();
    for (int64_t n0 = 0; n0 < N; n0 += kTile) {
      const int64_t rows = std::min(kTile, N - n0);
      for_each_range(rows, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n)
          dequantize_row(w + (n0 + n) * groups * (kBlock / 2), s + (n0 + n) * groups, groups, t + n * K);
      });
      out.narrow(1, n0, rows).copy_(at::mm(x, tile.narrow(0, 0, rows).t()));
    }
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // tasks of >= ~64 K multiply-adds
  for_each_range(N, std::max<int64_t>(1, (1 << 16) / (K * M)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      dequantize_row(w + n * groups * (kBlock / 2), s + n * groups, groups, row.data());
      dot_rows(row.data(), xp, M, K, o + n, N);
    }
  });
  return out;
}

}  // namespace blockserve
