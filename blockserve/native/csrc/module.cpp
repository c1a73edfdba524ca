// The one extension module of the native kernels (native/extension.py builds it): every entry
// point of kernels.h, and the decode stack, bound to Python.

#include <torch/python.h>

#include "decode_stack.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace blockserve;
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * weight, in place");
  m.def("rotary_", &rotary_, "rotate the first `heads` heads of each row of qkv in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [T, 2I] gate|up tensor");
  m.def("argmax_rows", &argmax_rows, "x [N, V] float32 -> int64 [N]: each row's first maximum (its first NaN)");
  m.def("delta_rule_rows", &delta_rule_rows,
        "(q, k [n, H, Dk], v [n, H, Dv], g [n, H] or [n, H, Dk] (log decay), beta [n, H], state table [S, H, Dk, "
        "Dv], source int64 [n], out [n, H, Dv], after [n, H, Dk, Dv]): the gated delta rule, row p from "
        "table[-source[p] - 1] or after[source[p]]");
  m.def("ssd_rows", &ssd_rows,
        "(x [n, H, P], dt [n, H], A [H], B, C [n, H, N], D [H], state table [S, H, P, N], source int64 [n], out "
        "[n, H, P], after [n, H, P, N]): Mamba2's SSD step, row p from table[-source[p] - 1] or after[source[p]]");
  m.def("sample_rows", &sample_rows,
        "(logits [M, V] float32, temperature [M] float32, top_k [M] int64 | None, top_p [M] float32 | None, min_p "
        "[M] float32 | None, uniforms [M] float64 in [0, 1)) -> int64 [M]: each row's token, drawn by inverse CDF "
        "from softmax(logits / temperature) after the filters (worker/sampler.py)",
        pybind11::call_guard<pybind11::gil_scoped_release>());

  m.def("reads_16bit", &reads_16bit, "whether float16 / bfloat16 caches are read at this head size");
  m.def("pool_sequences", &pool_sequences,
        "decode batches of up to this many sequences split their attention on the task pool, as the float32 "
        "blocks matmuls do (MAX_ROWS)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache, in place (out, q, k_cache, v_cache, block_table, key_start, "
        "seq_lens, scale)");
  m.def("paged_decode_attention_sinks", &paged_decode_attention_sinks,
        "paged_decode_attention with each query head's sink logit in the softmax's denominator (..., scale, sinks)");
  m.def("rotary_decode_attention", &rotary_decode_attention,
        "a decode-only step: rotate q, k of qkv in place, write k, v to the caches, attend (out, qkv, cos, sin, "
        "k_cache, v_cache, slot_mapping, block_table, key_start, seq_lens, n_heads, scale)");

  m.def("quantized_matmul", &quantized_matmul, "out [M, N] = x [M, K] @ W^T, W packed Q4_1 (q4_1=True) or Q8_0");
  m.def("quantized_matmul_int8", &quantized_matmul_int8,
        "out [M, N] = x [M, K] @ W^T as quantized_matmul, with x rounded to int8 per block of 32 (integer dots)");
  m.def("quantized_matmul_int16", &quantized_matmul_int16,
        "out [M, N] = x [M, K] @ W^T as quantized_matmul, with x rounded to int16 per block of 32 (integer dots)");
  m.def("quantized_dequantize", &quantized_dequantize,
        "(packed, out_features, in_features, q4_1, row_start, rows) -> W[row_start:row_start + rows] float32 [rows, K]");
  m.def("simd_lanes", &simd_lanes, "16: the AVX-512 path, 8: AVX2, 0: neither (quantized_matmul cannot run)");
  m.def("half_matmul", &half_matmul,
        "out [M, N] float32 = x [M, K] float32 @ W^T, W [N, K] bfloat16 or float16 widened in registers");
  m.def("half_matmul_lanes", &half_matmul_lanes, "16: the AVX-512 path, 8: AVX2 + F16C, 0: neither (half_matmul cannot run)");

  m.def("gguf_block_formats", &gguf_block_formats, "the GGUF formats gguf_dequantize and gguf_matmul read");
  m.def("gguf_dequantize", &gguf_dequantize,
        "(raw uint8 [N, row bytes], format, columns) -> float32 [N, columns], as gguf-py's dequantize",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_matmul", &gguf_matmul, "(x [M, K] float32, raw uint8 [N, row bytes], format) -> x @ W^T [M, N]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_matmul_int8", &gguf_matmul_int8,
        "(x [M, K] float32, raw uint8 [N, row bytes], format) -> x @ W^T [M, N] with x rounded to int8 per block "
        "of 32 (integer dots)", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_matmul_limbs", &gguf_matmul_limbs,
        "(x [M, K] float32, raw uint8 [N, row bytes], format) -> x @ W^T [M, N] to float32 rounding: x taken as "
        "four base-255 integer limbs per block of 32 (integer dots)", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_matmul_decode", &gguf_matmul_decode,
        "(x [M, K] float32, raw uint8 [N, row bytes], format) -> x @ W^T [M, N]: gguf_matmul_limbs up to 8 rows, "
        "gguf_matmul past them", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("mxfp4_matmul", &mxfp4_matmul,
        "(x [M, K] float32, blocks uint8 [N, K/32, 16], scales uint8 [N, K/32]) -> x @ W^T [M, N], W in MXFP4",
        pybind11::call_guard<pybind11::gil_scoped_release>());

  m.def("moe_experts", &moe_experts,
        "(x [T, H] float32, weights [T, k] float32, ids [T, k] int64, gate_up [E, 2I, H], down [E, H, I]) -> [T, H]: "
        "each token's weighted sum of its k SwiGLU experts",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("moe_experts_blocks", &moe_experts_blocks,
        "(x, weights, ids, gate, gate_format, up, up_format, down, down_format, intermediate, activations) -> [T, H]: "
        "moe_experts over GGUF blocks [E, rows, row bytes]; activations float32, int8 (x and h rounded per block "
        "of 32, integer dots: gguf_matmul_int8's bits) or int16 (rounded, float dots)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("moe_experts_mxfp4", &moe_experts_mxfp4,
        "(x, weights, ids, gate_up_blocks [E, 2I, H/32, 16], gate_up_scales, gate_up_bias [E, 2I], down_blocks "
        "[E, H, I/32, 16], down_scales, down_bias [E, H], alpha, limit) -> [T, H]: GPT-OSS's MXFP4 experts",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("moe_experts_gpt_oss", &moe_experts_gpt_oss,
        "(x, weights, ids, gate_up [E, H, 2I], gate_up_bias [E, 2I], down [E, I, H], down_bias [E, H], alpha, limit) "
        "-> [T, H]: GPT-OSS's float32 experts",
        pybind11::call_guard<pybind11::gil_scoped_release>());

  // GPT-OSS's experts in GGUF blocks (moe_experts.cpp)
  m.def("moe_experts_blocks_gpt_oss", &moe_experts_blocks_gpt_oss,
        "(x, weights, ids, gate, gate_format, up, up_format, down, down_format, gate_up_bias [E, 2I], "
        "down_bias [E, H], alpha, limit, activations) -> [T, H]: GPT-OSS's experts over GGUF blocks [E, rows, row "
        "bytes]; activations as moe_experts_blocks'",
        pybind11::call_guard<pybind11::gil_scoped_release>());

  // module_local: a second build of this module (-mno-avx512f, in tests) registers its own types.
  pybind11::class_<DecodeStack> stack(m, "DecodeStack", pybind11::module_local(), DecodeStack::kDoc);
  pybind11::class_<DecodeStack::Linear>(stack, "Linear", pybind11::module_local(),
                                        "one linear layer of the stack (packed_blocks or gguf_segments)")
      .def_static("packed_blocks", &DecodeStack::Linear::packed_blocks, DecodeStack::Linear::kPackedDoc,
                  pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("q4_1"), pybind11::arg("bias"))
      .def_static("gguf_segments", &DecodeStack::Linear::gguf_segments, DecodeStack::Linear::kSegmentsDoc,
                  pybind11::arg("segments"), pybind11::arg("bias"));
  stack
      .def(pybind11::init<std::vector<DecodeStack::Linear>, std::vector<at::Tensor>, std::vector<double>, std::string,
                          int64_t, double>(),
           pybind11::arg("linears"), pybind11::arg("norms"), pybind11::arg("eps"), pybind11::arg("activations"),
           pybind11::arg("num_heads"), pybind11::arg("scale"))
      // Without the GIL: a server's event loop streams tokens while the step's layers run.
      .def("run", &DecodeStack::run, DecodeStack::kRunDoc, pybind11::call_guard<pybind11::gil_scoped_release>());
}
