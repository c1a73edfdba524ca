// DecodeStack (decode_stack.h): a Llama-family decode step's layers in one native call.

#include "decode_stack.h"

#include "kernels.h"

namespace blockserve {

DecodeStack::DecodeStack(std::vector<at::Tensor> packed, std::vector<int64_t> out_features, std::vector<bool> q4_1,
                         std::vector<std::optional<at::Tensor>> biases, std::vector<at::Tensor> norms,
                         std::vector<double> eps, const std::string& activations, int64_t num_heads, double scale)
    : norms_(std::move(norms)), eps_(std::move(eps)), num_heads_(num_heads), scale_(scale) {
  if (activations == "float32") matmul_ = quantized_matmul;
  else if (activations == "int8") matmul_ = quantized_matmul_int8;
  else if (activations == "int16") matmul_ = quantized_matmul_int16;
  else TORCH_CHECK(false, "DecodeStack: activations must be float32, int8 or int16, not '", activations, "'");
  const size_t n = packed.size();
  TORCH_CHECK(n % 4 == 0 && out_features.size() == n && q4_1.size() == n && biases.size() == n,
              "DecodeStack: 4 linear layers per decoder layer, each with blocks, an output size, a flag and a bias");
  TORCH_CHECK(norms_.size() == n / 2 + 1 && eps_.size() == norms_.size(),
              "DecodeStack: two norms per decoder layer and a final one, each with its eps");
  for (size_t i = 0; i < n; ++i) linears_.push_back({packed[i], out_features[i], q4_1[i], biases[i]});
}

at::Tensor DecodeStack::linear(const Linear& layer, const at::Tensor& x) const {
  at::Tensor out = matmul_(x, layer.packed, layer.out_features, layer.q4_1);
  return layer.bias ? out.add_(*layer.bias) : out;
}

at::Tensor DecodeStack::run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                            const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                            const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
                            const std::vector<at::Tensor>& key_starts, const std::vector<at::Tensor>& seq_lens) const {
  const size_t layers = linears_.size() / 4;
  for (const auto* inputs : {&k_caches, &v_caches, &slot_mappings, &block_tables, &key_starts, &seq_lens})
    TORCH_CHECK(inputs->size() == layers, "DecodeStack.run: one cache and metadata tensor per layer (", layers,
                ") expected, got ", inputs->size());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "DecodeStack.run: float32 x [T, H] expected");
  at::Tensor residual = x;  // the embedding output becomes the residual stream
  x = at::rms_norm(x, {x.size(1)}, norms_[0], eps_[0]);
  for (size_t l = 0; l < layers; ++l) {
    const Linear* w = &linears_[4 * l];
    if (l > 0) add_rms_norm_(x, residual, norms_[2 * l], eps_[2 * l]);
    at::Tensor qkv = linear(w[0], x);
    const int64_t head_dim = qkv.size(1) / (num_heads_ + 2 * k_caches[l].size(2));  // the cache's rows may hold scales too
    at::Tensor attended = at::empty({qkv.size(0), num_heads_ * head_dim}, qkv.options());
    rotary_decode_attention(attended, qkv, cos, sin, k_caches[l], v_caches[l], slot_mappings[l], block_tables[l],
                            key_starts[l], seq_lens[l], num_heads_, scale_);
    x = linear(w[1], attended);
    add_rms_norm_(x, residual, norms_[2 * l + 1], eps_[2 * l + 1]);
    x = linear(w[3], silu_and_mul(linear(w[2], x)));
  }
  add_rms_norm_(x, residual, norms_[2 * layers], eps_[2 * layers]);
  return x;
}

}  // namespace blockserve
