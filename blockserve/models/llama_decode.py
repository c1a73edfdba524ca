"""A decode-only step of the Llama family as one flat loop over the layers' native calls.

At batch 1 a SmolLM2 decode step is ~8 native calls per layer, and the module tree around them
(a dozen module calls per layer, each re-checking what the step already settled) costs a sizeable
share of the step. When every row of the step is a decode and every op has its native kernel,
LlamaModel runs `decode_layers` instead: per layer

    add_rms_norm_ ─► qkv ─► rotary_decode_attention ─► o ─► add_rms_norm_ ─► gate_up ─► silu_and_mul ─► down

the same kernels on the same inputs in the same order as the module path (LlamaDecoderLayer with
its fused norms, RotaryDecode and GatedMLP), so the hidden states are bitwise equal
(tests/models/test_llama_decode.py). The linear layers run their own `forward` (blocks or float32
by row count, a row-parallel all-reduce under tensor parallelism). Anything the loop does not cover
(a prefill row, q/k norms, a sliding window, a kernel that is not built) returns None before
anything ran, and the module path runs. What does not change between steps (each layer's kernel,
caches and KV group) is settled on the first step and kept in ForwardContext.memo; a step derives
its metadata once per KV group, not once per layer.

Where every linear layer runs on GGUF blocks at this row count (no tensor parallelism), the whole
loop is one native call instead: csrc/decode_stack.h's DecodeStack, built on the first such step
over the layers' own tensors, calls the same kernels in the same order (the same bits again)
without the ~240 calls from Python per step, whose glue is a large share of a batch-1 step
(measured in docs/performance.md and docs/cpu.md). Each linear layer goes in as its module runs
it: a QuantizedLinear's packed Q4_0 / Q4_1 / Q8_0 blocks, or a GGUFBlockLinear's row segments in
the file's own formats (K-quants, 5-bit, IQ4; a fused projection's parts in formats of their own),
so a K-quant mix such as Q4_K_M runs in the stack too. The stack serves the rows every layer's
kernel serves: a QuantizedLinear's max_rows, a GGUFBlockLinear's MAX_ROWS with float32 or int16
activations (past it, its tiled GEMM), every row count with int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.native.extension import fused_ops
from blockserve.native.gate import native_reads
from blockserve.attention.rotary_decode import RotaryDecode
from blockserve.models.gguf_block_linear import MAX_ROWS as GGUF_MAX_ROWS, GGUFBlockLinear
from blockserve.models.quantized_linear import EVERY_ROW, QuantizedLinear


@dataclass(frozen=True)
class DecodePlan:
    """What decode_layers settles once per model and KV tensors: per layer the fused attention's
    fixed inputs (kernel, k_cache, v_cache) and its KV group; the step adds each group's metadata."""

    attention: tuple[tuple, ...]
    groups: tuple[int, ...]
    k_caches: tuple[torch.Tensor, ...]
    v_caches: tuple[torch.Tensor, ...]


def decode_plan(layers: nn.ModuleList, dtype: torch.dtype, ctx: ForwardContext) -> DecodePlan | None:
    """The plan for `layers` over ctx's caches (made on the first step, kept in ctx.memo), or None
    where some layer has no flat decode at all (no fused attention, MLP or norm; a sliding window)."""
    key = ("llama_decode", id(layers), dtype)
    if key not in ctx.memo:
        ctx.memo[key] = _make_plan(layers, dtype, ctx)
    return ctx.memo[key]


def _make_plan(layers: nn.ModuleList, dtype: torch.dtype, ctx: ForwardContext) -> DecodePlan | None:
    attention, groups = [], []
    for layer in layers:
        attn = layer.self_attn
        if attn.rotary_decode is None or layer.mlp.fused is None or layer.post_attention_layernorm.fused is None:
            return None
        cache = ctx.layers[attn.attn.layer_name]
        fixed = attn.rotary_decode.fixed(cache, dtype)
        if fixed is None:
            return None
        attention.append(fixed)
        groups.append(cache.group)
    return DecodePlan(tuple(attention), tuple(groups), tuple(a[1] for a in attention),
                      tuple(a[2] for a in attention))


def decode_layers(layers: nn.ModuleList, final_norm: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
    """x: the embedding output [T, H]; cos, sin: [T, 1, D / 2] as the rotary gives them. -> the final
    normed hidden states [T, H], or None when the step is not one the loop covers (x untouched)."""
    fused = fused_ops()
    if fused is None or x.dim() != 2 or not native_reads(x) or not native_reads(cos):
        return None
    plan = decode_plan(layers, x.dtype, ctx)
    if plan is None:
        return None
    per_group = {}
    for group in set(plan.groups):
        per_group[group] = RotaryDecode.step_inputs(ctx.metadata[group], x.shape[0])
        if per_group[group] is None:
            return None
    inputs = [per_group[group] for group in plan.groups]  # per layer: slot mapping, table, key start, seq lens
    cos, sin = cos[:, 0], sin[:, 0]
    stack = native_stack(layers, final_norm, x.shape[0])
    if stack is not None:
        return stack.run(x, cos, sin, plan.k_caches, plan.v_caches, *zip(*inputs))
    residual = None
    for layer, (kernel, k_cache, v_cache), step in zip(layers, plan.attention, inputs):
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        if residual is None:  # x is the embedding output: it becomes the residual stream
            residual, x = x, F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
        else:
            fused.add_rms_norm_(x, residual, norm.weight, norm.eps)
        qkv = attn.qkv_proj.forward(x)
        prepared = kernel, (k_cache, v_cache, *step, attn.num_heads, attn.attn.backend.scale)
        x = attn.o_proj.forward(attn.rotary_decode.run(prepared, qkv, cos, sin))
        norm = layer.post_attention_layernorm
        fused.add_rms_norm_(x, residual, norm.weight, norm.eps)
        x = mlp.down_proj.forward(fused.silu_and_mul(mlp.gate_up_proj.forward(x)))
    fused.add_rms_norm_(x, residual, final_norm.weight, final_norm.eps)
    return x


def native_stack(layers: nn.ModuleList, final_norm: nn.Module, rows: int):
    """The DecodeStack over `layers` (built on the first call, kept on `layers`), or None where it
    does not run this step: a linear layer not on GGUF blocks or whose kernel does not serve `rows`
    rows, tensor parallelism, linear layers of mixed activations, or attention layers of different
    head counts or scales."""
    if "_native_stack" not in layers.__dict__:
        layers.__dict__["_native_stack"] = _build_stack(layers, final_norm)
    built = layers.__dict__["_native_stack"]
    return built[0] if built is not None and rows <= built[1] else None


def _build_stack(layers: nn.ModuleList, final_norm: nn.Module):
    """(DecodeStack, the most rows every linear layer's kernel serves), or None (see native_stack)."""
    linears = [linear for layer in layers for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    attention = {(layer.self_attn.num_heads, layer.self_attn.attn.backend.scale) for layer in layers}
    if (not all(isinstance(linear, (QuantizedLinear, GGUFBlockLinear)) for linear in linears)
            or len(attention) != 1 or len({linear.activations for linear in linears}) != 1
            or any(_tensor_parallel(linear) for linear in linears)):
        return None
    (num_heads, scale), = attention
    norms = [norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms.append(final_norm)
    ops = fused_ops()
    stack = ops.DecodeStack([_stack_linear(ops.DecodeStack.Linear, linear) for linear in linears],
                            [norm.weight for norm in norms], [norm.eps for norm in norms], linears[0].activations,
                            num_heads, scale)
    return stack, min(_max_rows(linear) for linear in linears)


def _tensor_parallel(linear: QuantizedLinear | GGUFBlockLinear) -> bool:
    """Whether `linear` holds a tensor-parallel shard. A GGUFBlockLinear marks only a row-parallel
    one (its all-reduce); every Llama layer has two (o, down), so that is enough to see the model's."""
    return linear.sharded if isinstance(linear, QuantizedLinear) else linear.tp is not None


def _stack_linear(kind, linear: QuantizedLinear | GGUFBlockLinear):
    """`linear` as the stack runs it (`kind`: DecodeStack.Linear)."""
    if isinstance(linear, QuantizedLinear):
        return kind.packed_blocks(linear.packed, linear.out_features, linear.q4_1, linear.bias)
    return kind.gguf_segments([(segment.raw, segment.format) for segment in linear.segments], linear.bias)


def _max_rows(linear: QuantizedLinear | GGUFBlockLinear) -> int:
    """The most rows `linear`'s forward gives its blocks kernel (beyond them: a tiled GEMM)."""
    if isinstance(linear, QuantizedLinear):
        return linear.max_rows
    return EVERY_ROW if linear.integer_kernel else GGUF_MAX_ROWS
