// The entry points of the native CPU kernels. Each is defined in its own file (one concept per
// file) and all are linked into one extension module, bound to Python in module.cpp, so one
// kernel may call another's entry points directly (decode_stack.cpp runs whole decoder layers).
// The kernel files include ATen only (a third of torch/extension.h's compile time).

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace blockserve {

// fused_ops.cpp: elementwise steps of a decoder layer, one pass each (float32).
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_(at::Tensor qkv, int64_t heads, int64_t head_dim, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor gate_up);

// argmax.cpp: greedy sampling's per-row argmax, as torch's max(dim).indices.
at::Tensor argmax_rows(const at::Tensor& x);

// state_recurrence.cpp: the state layers' per-token recurrences over a step's decode rows; row p starts
// from table[-source[p] - 1] (a state slot) or after[source[p]] (an earlier row), writes its state to
// after[p] and its output to out[p].
void delta_rule_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, const at::Tensor& table, const at::Tensor& source, at::Tensor out,
                     at::Tensor after);
void ssd_rows(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
              const at::Tensor& C, const at::Tensor& D, const at::Tensor& table, const at::Tensor& source,
              at::Tensor out, at::Tensor after);

// sample.cpp: one token per row from the tempered softmax after top-k, top-p and min-p (inverse CDF).
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const std::optional<at::Tensor>& top_k,
                       const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p,
                       const at::Tensor& uniforms);

// paged_decode.cpp: decode attention read in place from the paged KV cache.
bool reads_16bit(int64_t head_size);
int64_t pool_sequences();
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens, double scale);
void paged_decode_attention_sinks(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens, double scale,
                                  at::Tensor sinks);
void rotary_decode_attention(at::Tensor out, at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                             at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_table,
                             at::Tensor key_start, at::Tensor seq_lens, int64_t n_heads, double scale);

// paged_decode_quantized.cpp: the same two over a quantized cache (attention/kv_quant.py: one-byte codes and
// a float16 scale, or rotated 4-bit codes; one-byte keys over 4-bit values); paged_decode.cpp's entry points
// call these for such a cache.
void paged_decode_attention_quantized(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens, double scale);
void rotary_decode_attention_quantized(at::Tensor out, at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                                       at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                                       at::Tensor block_table, at::Tensor key_start, at::Tensor seq_lens,
                                       int64_t n_heads, double scale);

// quantized_matmul.cpp: out = x @ W^T over GGUF blocks (float32, int8- or int16-rounded activations).
at::Tensor quantized_matmul(at::Tensor x, at::Tensor packed, int64_t out_features, bool q4_1);
at::Tensor quantized_matmul_int8(at::Tensor x, at::Tensor packed, int64_t out_features, bool q4_1);
at::Tensor quantized_matmul_int16(at::Tensor x, at::Tensor packed, int64_t out_features, bool q4_1);
// W's rows [row_start, row_start + rows) as float32 [rows, K] (row_start a multiple of 4): the values the
// blocks encode, for the many-row side (a tile dequantised and multiplied by the GEMM).
at::Tensor quantized_dequantize(at::Tensor packed, int64_t out_features, int64_t in_features, bool q4_1,
                                int64_t row_start, int64_t rows);
int64_t simd_lanes();

// half_matmul.cpp: out = x @ W^T, x float32, W [N, K] bfloat16 or float16 widened in registers (float32 sums).
at::Tensor half_matmul(at::Tensor x, at::Tensor weight);
int64_t half_matmul_lanes();

// gguf_blocks.cpp: the other GGUF block formats (5-bit, K-quants, IQ4) read in the file's layout.
std::vector<std::string> gguf_block_formats();
at::Tensor gguf_dequantize(at::Tensor raw, const std::string& format, int64_t columns);
at::Tensor gguf_matmul(at::Tensor x, at::Tensor raw, const std::string& format);
// gguf_blocks_int8.cpp: gguf_matmul with x rounded to int8 per block of 32 (integer dots; the same formats).
at::Tensor gguf_matmul_int8(at::Tensor x, at::Tensor raw, const std::string& format);
// gguf_blocks_int8.cpp: gguf_matmul with float32 x taken as four base-255 integer limbs per block of
// 32 (block_limbs.h) through the same integer dots: x @ W^T to float32 rounding.
at::Tensor gguf_matmul_limbs(at::Tensor x, at::Tensor raw, const std::string& format);
// gguf_blocks.cpp: a decode batch's float32 matmul: gguf_matmul_limbs up to 8 rows, gguf_matmul past them.
at::Tensor gguf_matmul_decode(at::Tensor x, at::Tensor raw, const std::string& format);

// mxfp4.cpp: out = x @ W^T, W [N, K] in MXFP4 (Hugging Face's blocks [N, K/32, 16] and e8m0 scales [N, K/32]).
at::Tensor mxfp4_matmul(at::Tensor x, at::Tensor blocks, at::Tensor scales);
// moe_experts.cpp: a mixture-of-experts layer's routed SwiGLU experts in one call, float32 or GGUF blocks,
// or GPT-OSS's experts (biases, clamped SwiGLU) in MXFP4 or float32.
at::Tensor moe_experts(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate_up, at::Tensor down);
at::Tensor moe_experts_blocks(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate,
                              const std::string& gate_format, at::Tensor up, const std::string& up_format,
                              at::Tensor down, const std::string& down_format, int64_t intermediate,
                              const std::string& activations);
at::Tensor moe_experts_mxfp4(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate_up_blocks,
                             at::Tensor gate_up_scales, at::Tensor gate_up_bias, at::Tensor down_blocks,
                             at::Tensor down_scales, at::Tensor down_bias, double alpha, double limit);
at::Tensor moe_experts_gpt_oss(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate_up,
                               at::Tensor gate_up_bias, at::Tensor down, at::Tensor down_bias, double alpha,
                               double limit);
// moe_experts.cpp: GPT-OSS's experts in GGUF blocks (gate, up [E, I, row bytes], down [E, H, row bytes]),
// the checkpoint's interleaved gate_up_bias [E, 2I] and down_bias [E, H], the clamped SwiGLU.
at::Tensor moe_experts_blocks_gpt_oss(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor gate,
                                      const std::string& gate_format, at::Tensor up, const std::string& up_format,
                                      at::Tensor down, const std::string& down_format, at::Tensor gate_up_bias,
                                      at::Tensor down_bias, double alpha, double limit, const std::string& activations);

}  // namespace blockserve
