"""The attention layer a model instantiates: it owns no weights, only the paged-cache read/write."""

from __future__ import annotations

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.paged_attention import PagedAttention


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads over the paged cache of layer `layer_name`.

    forward(q [T, Hq * D], k [T, Hkv * D], v [T, Hkv * D], ctx) -> [T, Hq * D]
    """

    def __init__(self, layer_name: str, num_heads: int, num_kv_heads: int, head_dim: int, backend: PagedAttention):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.backend = backend

    @property
    def reads_unwritten_slots(self) -> bool:
        """C1: declared by the backend; the engine derives its group's zero flag from it."""
        return self.backend.reads_unwritten_slots

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cache, meta = ctx.for_layer(self.layer_name)
        t = q.shape[0]
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            cache.k_cache,
            cache.v_cache,
            meta,
        )
        return out.view(t, self.num_heads * self.head_dim)
