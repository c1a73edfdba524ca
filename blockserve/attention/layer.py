"""The attention layer a model instantiates: it owns no weights, only the paged-cache read/write.

Every module that holds KV (this one; MLAttention, KimiDeltaAttention, GatedDeltaNet, Mamba2)
declares, in one place, what the engine needs of it (C1); nothing else lists its layers:

    layer_name              where its cache and metadata are found in the ForwardContext
    kv_cache_spec(bs)       what it stores per block of `bs` tokens (or per state slot)
    reads_unwritten_slots   whether its kernel reads slots that were never written
"""

from __future__ import annotations

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.paged_attention import PagedAttention
from blockserve.kv.specs import FullAttentionSpec, SlidingWindowSpec


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32": the names KV specs use (kv/ never imports torch)."""
    return str(dtype).removeprefix("torch.")


def backend_graph_blocker(backend) -> str | None:
    """Why an attention or MLA backend's decode cannot be captured as a CUDA graph (None: it can)."""
    if backend.captures_decode:
        return None
    return f"attention backend {backend.name!r} builds its gathers from host lists (use 'flex' or 'triton')"


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads over the paged cache of layer `layer_name`, in
    `dtype` (the model's), over the last `sliding_window` tokens when set (itself included).

    forward(q [T, Hq * D], k [T, Hkv * D], v [T, Hkv * D], ctx) -> [T, Hq * D]
    """

    def __init__(self, layer_name: str, num_heads: int, num_kv_heads: int, head_dim: int, backend: PagedAttention,
                 *, dtype: torch.dtype, sliding_window: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.backend = backend
        self.dtype = dtype
        self.sliding_window = sliding_window

    @property
    def reads_unwritten_slots(self) -> bool:
        """C1: declared by the backend; the engine derives its group's zero flag from it."""
        return self.backend.reads_unwritten_slots

    def cuda_graph_blocker(self) -> str | None:
        """Why a decode step through this layer cannot be captured as a CUDA graph (None: it can)."""
        return backend_graph_blocker(self.backend)

    def kv_cache_spec(self, block_size: int) -> FullAttentionSpec:
        if self.sliding_window is None:
            return FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, dtype_name(self.dtype))
        return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_dim, dtype_name(self.dtype),
                                 sliding_window=self.sliding_window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`sinks` [Hq]: each head's attention-sink logit, for a backend built with sinks=True."""
        cache, meta = ctx.for_layer(self.layer_name)
        if meta.sliding_window != self.sliding_window:  # a caller that forgot (or invented) the group's window
            raise ValueError(f"{self.layer_name} attends over window {self.sliding_window} "
                             f"but its metadata has sliding_window={meta.sliding_window}")
        t = q.shape[0]
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            cache.k_cache,
            cache.v_cache,
            meta,
            **({} if sinks is None else {"sinks": sinks}),
        )
        return out.view(t, self.num_heads * self.head_dim)
