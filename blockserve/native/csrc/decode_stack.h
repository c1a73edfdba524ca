// A decode-only step of a Llama-family decoder stack in one native call: per layer
//
//     add_rms_norm_ ─► qkv ─► rotary_decode_attention ─► o ─► add_rms_norm_ ─► gate_up ─► silu_and_mul ─► down
//
// then the final norm; the same entry points (kernels.h) on the same inputs in the same order as
// models/llama_decode.py's flat loop, so the hidden states are the same bits, without ~240 calls
// from Python per step. Every linear layer runs on its GGUF blocks (quantized_matmul, or
// quantized_matmul_int8 / _int16 by `activations`), so the caller uses it only for row counts the blocks serve.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace blockserve {

class DecodeStack {
 public:
  static constexpr const char* kDoc =
      "DecodeStack(packed, out_features, q4_1, biases, norms, eps, activations, num_heads, scale): the weights of L "
      "layers, 4 linear layers each (qkv, o, gate_up, down: their packed blocks, output sizes, Q4_1 flags and "
      "biases or None), 2 L + 1 norm weights and eps (input and post-attention per layer, then the final norm), "
      "the blocks' activations (float32, int8 or int16: QuantizedLinear's)";
  static constexpr const char* kRunDoc =
      "run(x, cos, sin, k_caches, v_caches, slot_mappings, block_tables, key_starts, seq_lens) -> the final "
      "normed hidden states [T, H]; x [T, H] the embedding output (used as the residual stream, modified), "
      "cos, sin [T, D / 2], then one tensor per layer for each of the decode attention's cache and metadata inputs";

  DecodeStack(std::vector<at::Tensor> packed, std::vector<int64_t> out_features, std::vector<bool> q4_1,
              std::vector<std::optional<at::Tensor>> biases, std::vector<at::Tensor> norms, std::vector<double> eps,
              const std::string& activations, int64_t num_heads, double scale);

  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
                 const std::vector<at::Tensor>& v_caches, const std::vector<at::Tensor>& slot_mappings,
                 const std::vector<at::Tensor>& block_tables, const std::vector<at::Tensor>& key_starts,
                 const std::vector<at::Tensor>& seq_lens) const;

 private:
  struct Linear {
    at::Tensor packed;
    int64_t out_features;
    bool q4_1;
    std::optional<at::Tensor> bias;
  };

  at::Tensor linear(const Linear& layer, const at::Tensor& x) const;

  std::vector<Linear> linears_;  // 4 per layer: qkv, o, gate_up, down
  std::vector<at::Tensor> norms_;
  std::vector<double> eps_;
  // The linear layers' kernel (quantized_matmul or one of its integer-activation forms).
  at::Tensor (*matmul_)(at::Tensor, at::Tensor, int64_t, bool);
  int64_t num_heads_;
  double scale_;
};

}  // namespace blockserve
