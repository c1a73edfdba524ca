// A decode-only step of a Llama-family decoder stack in one native call: per layer
//
//     add_rms_norm_ ─► qkv ─► rotary_decode_attention ─► o ─► add_rms_norm_ ─► gate_up ─► silu_and_mul ─► down
//
// then the final norm; the same entry points (kernels.h) on the same inputs in the same order as
// models/llama_decode.py's flat loop, so the hidden states are the same bits, without ~240 calls
// from Python per step. Every linear layer runs on GGUF blocks, each as its module does
// (DecodeStack::Linear): packed Q4_0 / Q4_1 / Q8_0 blocks (QuantizedLinear: quantized_matmul, or
// quantized_matmul_int8 / _int16 by `activations`), or row segments in the file's own formats
// (GGUFBlockLinear: gguf_matmul_decode, or gguf_matmul_int8 for int8; for int16 x rounded per block
// of 32 as round_per_block rounds it, then gguf_matmul_decode). The caller uses it only for row counts every
// layer's kernel serves.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace blockserve {

class DecodeStack {
 public:
  // One linear layer, out = x @ W^T (+ bias): W packed (quantized_matmul's layout, `out_features`
  // rows) or, where `segments` is not empty, the concatenation of GGUF row segments (raw, format).
  struct Linear {
    at::Tensor packed;
    int64_t out_features = 0;
    bool q4_1 = false;
    std::vector<std::pair<at::Tensor, std::string>> segments;
    std::optional<at::Tensor> bias;

    static constexpr const char* kPackedDoc =
        "packed_blocks(packed, out_features, q4_1, bias): a QuantizedLinear's packed blocks, output size, "
        "Q4_1 flag and bias or None";
    static constexpr const char* kSegmentsDoc =
        "gguf_segments(segments, bias): a GGUFBlockLinear's row segments [(raw uint8 [rows, row bytes], "
        "format)], concatenated along the output, and its bias or None";
    static Linear packed_blocks(at::Tensor packed, int64_t out_features, bool q4_1, std::optional<at::Tensor> bias);
    static Linear gguf_segments(std::vector<std::pair<at::Tensor, std::string>> segments,
                                std::optional<at::Tensor> bias);
  };

  static constexpr const char* kDoc =
      "DecodeStack(linears, norms, eps, activations, num_heads, scale): the weights of L layers, 4 "
      "DecodeStack.Linear each (qkv, o, gate_up, down), 2 L + 1 norm weights and eps (input and post-attention "
      "per layer, then the final norm), the linear layers' activations (float32, int8 or int16, the same for all)";
  static constexpr const char* kRunDoc =
      "run(x, cos, sin, k_caches, v_caches, slot_mappings, block_tables, key_starts, seq_lens) -> the final "
      "normed hidden states [T, H]; x [T, H] the embedding output (used as the residual stream, modified), "
      "cos, sin [T, D / 2], then one tensor per layer for each of the decode attention's cache and metadata inputs";

  DecodeStack(std::vector<Linear> linears, std::vector<at::Tensor> norms, std::vector<double> eps,
              const std::string& activations, int64_t num_heads, double scale);

  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
                 const std::vector<at::Tensor>& v_caches, const std::vector<at::Tensor>& slot_mappings,
                 const std::vector<at::Tensor>& block_tables, const std::vector<at::Tensor>& key_starts,
                 const std::vector<at::Tensor>& seq_lens) const;

 private:
  at::Tensor linear(const Linear& layer, const at::Tensor& x) const;

  std::vector<Linear> linears_;  // 4 per layer: qkv, o, gate_up, down
  std::vector<at::Tensor> norms_;
  std::vector<double> eps_;
  // The packed layers' kernel (quantized_matmul or one of its integer-activation forms).
  at::Tensor (*matmul_)(at::Tensor, at::Tensor, int64_t, bool);
  // The segments' kernel (gguf_matmul_decode, or gguf_matmul_int8), and the levels x is rounded to first (int16), or 0.
  at::Tensor (*gguf_matmul_)(at::Tensor, at::Tensor, const std::string&);
  int64_t gguf_levels_ = 0;
  int64_t num_heads_;
  double scale_;
};

}  // namespace blockserve
