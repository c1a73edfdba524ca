// DecodeStack (decode_stack.h): a Llama-family decode step's layers in one native call.

#include "decode_stack.h"

#include <algorithm>

#include "kernels.h"

namespace blockserve {
namespace {

// x [T, K] rounded per block of 32 to `levels` either side of zero, back in float32: the ATen
// operations of models/quantized_linear.py's round_per_block in its order, so the same bits.
at::Tensor round_per_block(const at::Tensor& x, int64_t levels) {
  const at::Tensor blocks = x.reshape({x.size(0), -1, 32});
  const at::Tensor amax = blocks.abs().amax(-1, /*keepdim=*/true);
  const at::Tensor inv =
      at::where(amax > 0, at::full_like(amax, static_cast<double>(levels)) / amax, at::zeros_like(amax));
  return (at::round(blocks * inv) * (amax / levels)).reshape(x.sizes());
}

}  // namespace

DecodeStack::Linear DecodeStack::Linear::packed_blocks(at::Tensor packed, int64_t out_features, bool q4_1,
                                                       std::optional<at::Tensor> bias) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && out_features > 0,
              "DecodeStack.Linear.packed_blocks: uint8 packed blocks and a positive output size expected");
  Linear linear;
  linear.packed = std::move(packed);
  linear.out_features = out_features;
  linear.q4_1 = q4_1;
  linear.bias = std::move(bias);
  return linear;
}

DecodeStack::Linear DecodeStack::Linear::gguf_segments(std::vector<std::pair<at::Tensor, std::string>> segments,
                                                       std::optional<at::Tensor> bias) {
  TORCH_CHECK(!segments.empty(), "DecodeStack.Linear.gguf_segments: at least one (raw, format) segment expected");
  const std::vector<std::string> formats = gguf_block_formats();
  Linear linear;
  for (const auto& [raw, format] : segments) {
    TORCH_CHECK(std::find(formats.begin(), formats.end(), format) != formats.end(),
                "DecodeStack.Linear.gguf_segments: no block kernel for GGUF format '", format, "'");
    TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
                "DecodeStack.Linear.gguf_segments: contiguous uint8 blocks [rows, row bytes] expected");
    linear.out_features += raw.size(0);
  }
  linear.segments = std::move(segments);
  linear.bias = std::move(bias);
  return linear;
}

DecodeStack::DecodeStack(std::vector<Linear> linears, std::vector<at::Tensor> norms, std::vector<double> eps,
                         const std::string& activations, int64_t num_heads, double scale)
    : linears_(std::move(linears)), norms_(std::move(norms)), eps_(std::move(eps)), num_heads_(num_heads),
      scale_(scale) {
  if (activations == "float32") {
    matmul_ = quantized_matmul;
    gguf_matmul_ = gguf_matmul_decode;
  } else if (activations == "int8") {
    matmul_ = quantized_matmul_int8;
    gguf_matmul_ = gguf_matmul_int8;
  } else if (activations == "int16") {  // GGUFBlockLinear's int16: x rounded, then the float kernel
    matmul_ = quantized_matmul_int16;
    gguf_matmul_ = gguf_matmul_decode;
    gguf_levels_ = 32767;
  } else {
    TORCH_CHECK(false, "DecodeStack: activations must be float32, int8 or int16, not '", activations, "'");
  }
  TORCH_CHECK(linears_.size() % 4 == 0, "DecodeStack: 4 linear layers per decoder layer (qkv, o, gate_up, down), "
              "got ", linears_.size());
  TORCH_CHECK(norms_.size() == linears_.size() / 2 + 1 && eps_.size() == norms_.size(),
              "DecodeStack: two norms per decoder layer and a final one, each with its eps");
}

at::Tensor DecodeStack::linear(const Linear& layer, const at::Tensor& x) const {
  at::Tensor out;
  if (layer.segments.empty()) {
    out = matmul_(x, layer.packed, layer.out_features, layer.q4_1);
  } else {
    const at::Tensor rows = gguf_levels_ ? round_per_block(x, gguf_levels_) : x;
    std::vector<at::Tensor> outs;
    outs.reserve(layer.segments.size());
    for (const auto& [raw, format] : layer.segments) outs.push_back(gguf_matmul_(rows, raw, format));
    out = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  }
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
