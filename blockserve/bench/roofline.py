"""The fp32 roofline of a workload: the compute bound (GEMM peak measured on the spot) and the
batch-1 weight-bandwidth bound (copy bandwidth measured on the spot), for fp32 weights and for
the weights as loaded (a GGUF model's layers also keep their quantized blocks for small
batches). Shared by `blockserve bench` and benchmarks/peers/run.py.

FLOPs: 2 x linear params per computed token, the (tied) lm_head only where a token is sampled,
plus attention 4 x layers x q_heads x head_dim x context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from blockserve.models.weight_layout import PanelLinear


def measure_gemm_peak(n: int = 2048, reps: int = 10) -> float:
    """Best fp32 GFLOP/s of n x n @ n x n matmuls (into a preallocated output)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def measure_shaped_gemm(m: int, k: int, n: int, reps: int = 20) -> float:
    """Best fp32 GFLOP/s of x[m, k] @ W[n, k].T (an nn.Linear of the model's shape)."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def measure_read_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Best GB/s of reading a large fp32 tensor once (a sum), as weight reads are read-only."""
    src = torch.randn(mib * 2**20 // 4)
    src.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best / 1e9


def measure_copy_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Best GB/s (bytes read + bytes written) of a large fp32 tensor copy."""
    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


@dataclass(frozen=True)
class ModelShape:
    params: int  # every parameter (the tied embedding once)
    linear_params: int  # weights of the decoder's linear layers (what every computed token multiplies)
    lm_head_params: int  # vocab x hidden (tied or not): multiplied only where a token is sampled
    layers: int
    q_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    batch1_weight_bytes: int  # weights a batch-1 step reads: GGUF blocks where a layer keeps them, else fp32

    @staticmethod
    def of(model: torch.nn.Module, hf_config) -> ModelShape:
        params = sum(p.numel() for p in model.parameters())
        linear = sum(m.in_features * m.out_features for name, m in model.named_modules()
                     if isinstance(m, (torch.nn.Linear, PanelLinear)) and "lm_head" not in name)
        blocks = [m for m in model.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)]
        batch1_bytes = 4 * params - sum(4 * m.in_features * m.out_features - m.packed.numel() for m in blocks)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return ModelShape(params, linear, hf_config.vocab_size * hf_config.hidden_size, hf_config.num_hidden_layers,
                          hf_config.num_attention_heads, head_dim, hf_config.hidden_size, hf_config.intermediate_size,
                          batch1_bytes)

    def attention_flops(self, context: float) -> float:
        """QK^T and PV of one query token over `context` keys, every layer."""
        return 4 * self.layers * self.q_heads * self.head_dim * context


def workload_flops(shape: ModelShape, prompt_lens: list[int], max_tokens: int,
                   cached_prompt_tokens: list[int] | None = None) -> dict:
    """FLOPs of the work actually done: each request computes its P + G - 1 token positions
    (the last sampled token is never fed back) except the C leading ones served from the prefix
    cache (`cached_prompt_tokens[i]`, default none), and G lm_head rows."""
    linear = attn = head = 0.0
    positions = contexts = 0
    for p, c in zip(prompt_lens, cached_prompt_tokens or [0] * len(prompt_lens)):
        n = p + max_tokens - 1
        positions += n - c
        contexts += n * (n + 1) // 2 - c * (c + 1) // 2  # position t attends t + 1 keys
        linear += 2 * shape.linear_params * (n - c)
        head += 2 * shape.lm_head_params * max_tokens
    attn = shape.attention_flops(contexts)
    generated = len(prompt_lens) * max_tokens
    return {
        "linear": linear, "lm_head": head, "attention": attn, "total": linear + head + attn,
        "computed_positions": positions, "generated_tokens": generated,
        "avg_context": contexts / positions,
        "per_generated_token": (linear + head + attn) / generated,
        "rule_of_thumb_per_token": 2 * shape.params + shape.attention_flops(contexts / positions),
    }


def roofline(shape: ModelShape, prompt_lens: list[int], max_tokens: int,
             cached_prompt_tokens: list[int] | None = None) -> dict:
    square = measure_gemm_peak()
    shaped = {f"{m}x{k}x{n}": measure_shaped_gemm(m, k, n)
              for m in (1, 16, 64, 256) for k, n in ((shape.hidden, 2 * shape.intermediate),)}
    gemm = max(square, *shaped.values())  # the best rate seen is the peak (a loaded machine only lowers it)
    copy_bw = measure_copy_bandwidth()
    read_bw = measure_read_bandwidth()
    flops = workload_flops(shape, prompt_lens, max_tokens, cached_prompt_tokens)
    compute_s = flops["total"] / (gemm * 1e9)
    weight_bytes = 4 * shape.params  # fp32; the tied embedding is read once, by the lm_head
    bw_s = weight_bytes / (copy_bw * 1e9)
    return {
        "gemm_peak_gflops": gemm,
        "gemm_2048_gflops": square,
        "linear_gflops_model_shapes": shaped,
        "copy_bandwidth_gbs": copy_bw,
        "read_bandwidth_gbs": read_bw,
        "flops": flops,
        "compute_bound_s": compute_s,
        "compute_bound_tok_s": flops["generated_tokens"] / compute_s,
        "weight_bytes_per_token": weight_bytes,
        "batch1_bandwidth_bound_ms_per_token": bw_s * 1e3,
        "batch1_bandwidth_bound_tok_s": 1 / bw_s,
        "batch1_read_bandwidth_bound_ms_per_token": weight_bytes / (read_bw * 1e9) * 1e3,
        **_as_loaded_bound(shape, copy_bw),
    }



def batch1_bandwidth_bound(shape: ModelShape) -> dict:
    """The batch-1 decode bound: every fp32 weight read once per token at the copy bandwidth."""
    copy_bw = measure_copy_bandwidth()
    weight_bytes = 4 * shape.params
    return {"copy_bandwidth_gbs": copy_bw, "weight_bytes_per_token": weight_bytes,
            "batch1_bandwidth_bound_ms_per_token": weight_bytes / (copy_bw * 1e9) * 1e3,
            **_as_loaded_bound(shape, copy_bw)}


def _as_loaded_bound(shape: ModelShape, copy_bw: float) -> dict:
    """The batch-1 bound for the weights as loaded (GGUF blocks where layers keep them)."""
    return {"loaded_weight_bytes_per_token": shape.batch1_weight_bytes,
            "batch1_loaded_bound_ms_per_token": shape.batch1_weight_bytes / (copy_bw * 1e9) * 1e3}


def loaded_bound_line(roof: dict) -> str:
    """A line on the as-loaded batch-1 bound; empty when the weights are all fp32."""
    if roof["loaded_weight_bytes_per_token"] == roof["weight_bytes_per_token"]:
        return ""
    return (f"batch-1 bound as loaded (GGUF blocks for small batches, fp32 elsewhere): "
            f"{roof['loaded_weight_bytes_per_token'] / 1e6:.0f} MB per token -> "
            f"{roof['batch1_loaded_bound_ms_per_token']:.1f} ms/token")


def report_lines(roof: dict, generated_tok_s: float | None = None) -> list[str]:
    """The roofline as printed lines, with the measured throughput's fraction of the compute bound."""
    f = roof["flops"]
    shaped = ", ".join(f"{k} {v:.0f}" for k, v in roof["linear_gflops_model_shapes"].items())
    lines = [
        f"GEMM peak {roof['gemm_peak_gflops']:.0f} GFLOP/s (best of: 2048^3 matmul {roof['gemm_2048_gflops']:.0f}; "
        f"model-shaped linears [MxKxN] {shaped})",
        f"memory bandwidth: copy {roof['copy_bandwidth_gbs']:.1f} GB/s, read-only {roof['read_bandwidth_gbs']:.1f} GB/s",
        f"workload: {f['total'] / 1e12:.4f} TFLOP = linear {f['linear'] / 1e12:.4f} + lm_head {f['lm_head'] / 1e12:.4f} "
        f"+ attention {f['attention'] / 1e12:.4f}; {f['per_generated_token'] / 1e6:.0f} MFLOP per generated token, "
        f"prefill included",
        f"compute bound: {roof['compute_bound_tok_s']:.0f} tok/s ({roof['compute_bound_s']:.2f} s for the workload)",
        f"batch-1 weight-bandwidth bound: {roof['weight_bytes_per_token'] / 1e6:.0f} MB of fp32 weights per token -> "
        f"{roof['batch1_bandwidth_bound_ms_per_token']:.1f} ms/token ({roof['batch1_bandwidth_bound_tok_s']:.1f} tok/s); "
        f"batch-1 inter-token latency: `blockserve bench latency --batch-sizes 1`",
    ]
    if loaded_bound_line(roof):
        lines.append(loaded_bound_line(roof))
    if generated_tok_s is not None:
        lines.append(f"blockserve: {generated_tok_s:.1f} tok/s = {100 * generated_tok_s / roof['compute_bound_tok_s']:.1f}% "
                     f"of the compute roofline")
    return lines
