"""A decode-only step of the Llama family as one flat loop over the layers' native calls.

At batch 1 a SmolLM2 decode step is ~8 native calls per layer, and the module tree around them
(a dozen module calls per layer, each re-checking what the step already settled) costs a sizeable
share of the step. When every row of the step is a decode and every op has its native kernel,
LlamaModel runs `decode_layers` instead: per layer

    add_rms_norm_ ─► qkv ─► rotary_decode_attention ─► o ─► add_rms_norm_ ─► gate_up ─► silu_and_mul ─► down

the same kernels on the same inputs in the same order as the module path (LlamaDecoderLayer with
its fused norms, RotaryDecode and GatedMLP), so the hidden states are bitwise equal
(tests/test_llama_decode.py). The linear layers run their own `forward` (blocks or float32 by row
count, a row-parallel all-reduce under tensor parallelism). Anything the loop does not cover (a
prefill row, q/k norms, a sliding window, a kernel that is not built) returns None before
anything ran, and the module path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.native import fused_ops


def decode_layers(layers: nn.ModuleList, final_norm: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
    """x: the embedding output [T, H]; cos, sin: [T, 1, D / 2] as the rotary gives them. -> the final
    normed hidden states [T, H], or None when the step is not one the loop covers (x untouched)."""
    fused = fused_ops()
    if fused is None or x.dim() != 2:
        return None
    cos, sin = cos[:, 0], sin[:, 0]
    prepared = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.rotary_decode is None or mlp.fused is None or layer.post_attention_layernorm.fused is None:
            return None
        step = attn.rotary_decode.prepare(x, cos, ctx)
        if step is None:
            return None
        prepared.append(step)
    residual = None
    for layer, step in zip(layers, prepared):
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        if residual is None:  # x is the embedding output: it becomes the residual stream
            residual, x = x, F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
        else:
            fused.add_rms_norm_(x, residual, norm.weight, norm.eps)
        qkv = attn.qkv_proj.forward(x)
        x = attn.o_proj.forward(attn.rotary_decode.run(step, qkv, cos, sin))
        norm = layer.post_attention_layernorm
        fused.add_rms_norm_(x, residual, norm.weight, norm.eps)
        x = mlp.down_proj.forward(fused.silu_and_mul(mlp.gate_up_proj.forward(x)))
    fused.add_rms_norm_(x, residual, final_norm.weight, final_norm.eps)
    return x
