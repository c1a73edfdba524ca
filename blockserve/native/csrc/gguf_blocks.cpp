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
//       each output row is dequantised once into a per-task buffer of K floats (L1/L2) and
//       dotted with the M rows of x, so the weights are read from memory at their file size.
//
// Both run on the process's TaskPool (task_pool.h), over ranges of output rows. The vector code is
// the compiler's (-march=native, or -mno-avx512f for the AVX2 build): the dequantisers are loops
// over 16 or 32 contiguous values and the dots plain reductions, which it vectorises at the
// build's width.

#include "kernels.h"

#include "row_dot.h"
#include "task_pool.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace blockserve {
namespace {

constexpr int kK = 256;  // K-quant super-block

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    while (!(mantissa & 0x400)) { mantissa <<= 1; ++shift; }
    bits = sign | (uint32_t(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
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

// Each dequantises one block (Elems values) at `b` into `y`.
struct Q4_0 {
  static constexpr int Elems = 32, Bytes = 18;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(int(qs[j] & 0x0f) - 8);
      y[j + 16] = d * float(int(qs[j] >> 4) - 8);
    }
  }
};

struct Q4_1 {
  static constexpr int Elems = 32, Bytes = 20;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(qs[j] & 0x0f) + m;
      y[j + 16] = d * float(qs[j] >> 4) + m;
    }
  }
};

struct Q8_0 {
  static constexpr int Elems = 32, Bytes = 34;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = d * float(qs[j]);
  }
};

struct Q5_0 {
  static constexpr int Elems = 32, Bytes = 22;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(int((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - 16);
      y[j + 16] = d * float(int((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  }
};

struct Q5_1 {
  static constexpr int Elems = 32, Bytes = 24;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) + m;
      y[j + 16] = d * float((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
  }
};

struct IQ4_NL {
  static constexpr int Elems = 32, Bytes = 18;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(kNonLinear4[qs[j] & 0x0f]);
      y[j + 16] = d * float(kNonLinear4[qs[j] >> 4]);
    }
  }
};

struct Q2_K {  // scales[16] | qs[64] | d | dmin
  static constexpr int Elems = kK, Bytes = 84;
  static void dequantize(const uint8_t* b, float* y) {
    const uint8_t* scales = b;
    const uint8_t* qs = b + 16;
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int half = 0; half < 2; ++half)
      for (int shift = 0; shift < 4; ++shift)
        for (int l = 0; l < 32; ++l) {
          const int w = half * 128 + shift * 32 + l;
          const uint8_t sc = scales[w / 16];
          y[w] = d * float(sc & 0x0f) * float((qs[half * 32 + l] >> (2 * shift)) & 3) - dmin * float(sc >> 4);
        }
  }
};

struct Q3_K {  // hmask[32] | qs[64] | scales[12] | d
  static constexpr int Elems = kK, Bytes = 110;
  static void dequantize(const uint8_t* b, float* y) {
    const uint8_t* hmask = b;
    const uint8_t* qs = b + 32;
    const uint8_t* s = b + 96;
    const float d = half_to_float(b + 108);
    float dl[16];
    for (int i = 0; i < 16; ++i) {
      const int low = (s[i % 8] >> (4 * (i / 8))) & 0x0f, high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
      dl[i] = d * float((low | (high << 4)) - 32);
    }
    for (int half = 0; half < 2; ++half)
      for (int shift = 0; shift < 4; ++shift)
        for (int l = 0; l < 32; ++l) {
          const int w = half * 128 + shift * 32 + l;
          const int q = ((qs[half * 32 + l] >> (2 * shift)) & 3) - (((hmask[l] >> (w / 32)) & 1) ? 0 : 4);
          y[w] = dl[w / 16] * float(q);
        }
  }
};

struct Q4_K {  // d | dmin | scales[12] | qs[128]
  static constexpr int Elems = kK, Bytes = 144;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* qs = b + 16;
    for (int chunk = 0; chunk < 4; ++chunk) {  // 64 weights: the low nibbles of 32 bytes, then the high
      for (int part = 0; part < 2; ++part) {
        uint8_t sc, m;
        scale_min_k4(b + 4, 2 * chunk + part, &sc, &m);
        const float scale = d * float(sc), min = dmin * float(m);
        float* out = y + 64 * chunk + 32 * part;
        for (int l = 0; l < 32; ++l) out[l] = scale * float((qs[32 * chunk + l] >> (4 * part)) & 0x0f) - min;
      }
    }
  }
};

struct Q5_K {  // d | dmin | scales[12] | qh[32] | qs[128]
  static constexpr int Elems = kK, Bytes = 176;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    for (int chunk = 0; chunk < 4; ++chunk) {
      for (int part = 0; part < 2; ++part) {
        const int sub = 2 * chunk + part;
        uint8_t sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const float scale = d * float(sc), min = dmin * float(m);
        float* out = y + 32 * sub;
        for (int l = 0; l < 32; ++l)
          out[l] = scale * float(((qs[32 * chunk + l] >> (4 * part)) & 0x0f) | (((qh[l] >> sub) & 1) << 4)) - min;
      }
    }
  }
};

struct Q6_K {  // ql[128] | qh[64] | scales[16] int8 | d
  static constexpr int Elems = kK, Bytes = 210;
  static void dequantize(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    for (int half = 0; half < 2; ++half)
      for (int group = 0; group < 4; ++group) {
        const int w0 = 128 * half + 32 * group;
        const float scale0 = d * float(scales[w0 / 16]), scale1 = d * float(scales[w0 / 16 + 1]);
        for (int l = 0; l < 32; ++l) {
          const int low = (ql[64 * half + 32 * (group % 2) + l] >> (4 * (group / 2))) & 0x0f;
          const int high = (qh[32 * half + l] >> (2 * group)) & 3;
          y[w0 + l] = (l < 16 ? scale0 : scale1) * float((low | (high << 4)) - 32);
        }
      }
  }
};

struct IQ4_XS {  // d | scales_h (uint16) | scales_l[4] | qs[128]
  static constexpr int Elems = kK, Bytes = 136;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = half_to_float(b);
    uint16_t scales_h;
    std::memcpy(&scales_h, b + 2, 2);
    const uint8_t* scales_l = b + 4;
    const uint8_t* qs = b + 8;
    for (int sub = 0; sub < 8; ++sub) {
      const int scale = (((scales_l[sub / 2] >> (4 * (sub % 2))) & 0x0f) | (((scales_h >> (2 * sub)) & 3) << 4)) - 32;
      const float dl = d * float(scale);
      for (int j = 0; j < 16; ++j) {
        y[32 * sub + j] = dl * float(kNonLinear4[qs[16 * sub + j] & 0x0f]);
        y[32 * sub + 16 + j] = dl * float(kNonLinear4[qs[16 * sub + j] >> 4]);
      }
    }
  }
};

template <typename F>
void dequantize_row(const uint8_t* row, int64_t columns, float* out) {
  for (int64_t b = 0; b < columns / F::Elems; ++b) F::dequantize(row + b * F::Bytes, out + b * F::Elems);
}

struct Format {
  int64_t elems, bytes;
  void (*dequantize_row)(const uint8_t*, int64_t, float*);
};

template <typename F>
constexpr Format format_of() {
  return {F::Elems, F::Bytes, &dequantize_row<F>};
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
  // tasks of >= ~64 K multiply-adds
  for_each_range(N, std::max<int64_t>(1, (1 << 16) / (K * std::max<int64_t>(M, 1))), [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      f.dequantize_row(w + n * row_bytes, K, row.data());
      dot_rows(row.data(), xp, M, K, o + n, N);
    }
  });
  return out;
}

}  // namespace blockserve
