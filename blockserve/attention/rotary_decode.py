"""A decode-only step of a rotate_half-RoPE attention layer in one native call.

At batch 1 a decoder layer's attention is ~15 small tensor ops (rotary, two cache writes, views,
the decode kernel): their Python and dispatch cost rivals the math. When every row of the step
is a decode, csrc/paged_decode.cpp's rotary_decode_attention does all of it in one pass:

    qkv [T, (Hq + 2 Hkv) D] ─► rotate q, k in place ─► write k, v at slot_mapping ─► attend ─► [T, Hq * D]

It is exactly what the reference path computes (fused rotary_, the backend's cache write and
its native decode kernel), so results do not change. Over the rotated 4-bit form (int4, and k8v4's
values) the call also does what attention/kv_quant.py does around the kernel: rotates k, v (and q,
where the keys are rotated) before quantising them, and un-rotates the output once. Anything else
(prefill rows, a sliding window, attention sinks, a backend without the native kernel, a dtype or
device the kernel does not take) returns None and the caller runs the reference path.
"""

from __future__ import annotations

import torch

from blockserve.attention.context import ForwardContext, LayerCache
from blockserve.attention.layer import Attention
from blockserve.attention.metadata import AttentionMetadata
from blockserve.native.extension import PagedDecodeKernel
from blockserve.native.gate import native_reads


class RotaryDecode:
    """`RotaryDecode(attn)(qkv, cos, sin, ctx)` -> attention output [T, Hq * D], or None when the
    step is not one the fused call covers (then nothing was modified). cos, sin [T, D / 2].
    The same in two halves: `prepare(x, cos, ctx)` (x: any tensor of qkv's device and dtype) says
    whether the step is covered, before anything runs; `run(prepared, qkv, cos, sin)` does it.
    `prepare` is itself two halves, for callers that settle the fixed half once: `fixed(cache,
    dtype)` (per layer, the same every step) and `step_inputs(meta, t)` (per step and KV group)."""

    def __init__(self, attn: Attention):
        self.attn = attn

    def _kernel(self) -> PagedDecodeKernel | None:
        """The backend's own native decode kernel: None where it has none (or it was switched off),
        or where the layer has attention sinks (the one-call decode takes none)."""
        if getattr(self.attn.backend, "sinks", False):
            return None
        return getattr(self.attn.backend, "decode_kernel", None)

    def fixed(self, cache: LayerCache, dtype: torch.dtype) -> tuple | None:
        """(kernel, k_cache, v_cache) where the fused call covers this layer for activations of
        `dtype` on the CPU reading `cache`, else None: what does not change from step to step."""
        attn = self.attn
        kernel = self._kernel()
        k_dtype, v_dtype = cache.k_cache.dtype, cache.v_cache.dtype
        if (kernel is None or attn.sliding_window is not None or cache.k_cache.device.type != "cpu"
                or not kernel.reads(dtype, k_dtype, attn.head_dim, None if v_dtype == k_dtype else v_dtype)):
            return None
        return kernel, cache.k_cache, cache.v_cache

    @staticmethod
    def step_inputs(meta: AttentionMetadata, t: int) -> tuple | None:
        """(slot_mapping, block_table, key_start, seq_lens) of a KV group's metadata for a step of `t`
        decode rows, or None when the step has other rows (or a sliding window). Derived once per
        step and group: every layer of the group passes the same tensors."""
        layout = meta.layout
        if layout.num_decodes != t or layout.num_seqs != t or meta.sliding_window is not None:
            return None
        table, key_start, seq_lens = meta.derive(("rotary_decode", "seqs"), lambda host: (
            host.block_table[:t].contiguous(), host.key_start[:t].contiguous(), host.seq_len[:t].contiguous()))
        return meta.slot_mapping, table, key_start, seq_lens

    def prepare(self, x: torch.Tensor, cos: torch.Tensor, ctx: ForwardContext) -> tuple | None:
        """The kernel and its cache and metadata arguments for this step, or None when not covered."""
        if not native_reads(x) or not native_reads(cos):
            return None
        cache, meta = ctx.for_layer(self.attn.layer_name)
        fixed = self.fixed(cache, x.dtype)
        inputs = None if fixed is None else self.step_inputs(meta, x.shape[0])
        if inputs is None:
            return None
        kernel, k_cache, v_cache = fixed
        return kernel, (k_cache, v_cache, *inputs, self.attn.num_heads, self.attn.backend.scale)

    def run(self, prepared: tuple, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        kernel, (k_cache, v_cache, slot_mapping, table, key_start, seq_lens, num_heads, scale) = prepared
        out = qkv.new_empty(qkv.shape[0], num_heads * self.attn.head_dim)
        kernel.rotary_decode(out, qkv, cos, sin, k_cache, v_cache, slot_mapping, table, key_start, seq_lens,
                             num_heads, scale)
        return out

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor | None:
        prepared = self.prepare(qkv, cos, ctx)
        return None if prepared is None else self.run(prepared, qkv, cos, sin)
