"""The `triton` backends: paged attention and MLA through our own Triton kernel (triton_paged.py),
every row of a step (decodes and prefill chunks) in one launch per layer.

    attention   q [T, Hq, D] over the pages of k_cache / v_cache [N, bs, Hkv, D]
    MLA         absorbed, as FlexMLA: q = [W_UK_h^T q_nope_h | q_rope_h] over the latent rows
                [c | k_rope] of cache [N, bs, R + Dr] (one KV head shared by all query heads),
                values c; out_h = W_UV_h (softmax(q . row) c)

The kernel reads only slots its rows may see (masked page loads), so reads_unwritten_slots =
False: recycled blocks need no zeroing (C1). It reads no host list, so decode steps are captured
as CUDA graphs. On the CPU it runs in Triton's interpreter, for tests (TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from blockserve.attention.metadata import AttentionMetadata
from blockserve.attention.triton_paged import paged_attention


class TritonAttention:
    """The paged-attention backend `triton` (same forward contract as paged_attention.PagedAttention)."""

    name: ClassVar[str] = "triton"
    reads_unwritten_slots: ClassVar[bool] = False  # page loads are masked to written slots
    captures_decode: ClassVar[bool] = True  # reads no host list

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [num_pages, bs, Hkv, D] -> [T, Hq, D]."""
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        return paged_attention(q.new_empty(q.shape), q, k_cache, v_cache, meta, self.scale)


class TritonMLA:
    """The MLA backend `triton` (same forward contract as mla.MLABackend)."""

    name: ClassVar[str] = "triton"
    reads_unwritten_slots: ClassVar[bool] = False
    captures_decode: ClassVar[bool] = True

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, q_nope, q_rope, latent, k_rope, w_uk, w_uv, cache, meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T, H, Dn], q_rope [T, H, Dr], latent [T, R], k_rope [T, Dr], w_uk [H, Dn, R],
        w_uv [H, Dv, R], cache [num_pages, bs, R + Dr] -> [T, H, Dv]."""
        rank = latent.shape[-1]
        rows_in = torch.cat([latent, k_rope], dim=-1).to(cache.dtype)
        cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, rows_in)
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        pages = cache[:, :, None]  # [N, bs, 1, R + Dr]: one KV head
        out_lat = paged_attention(q_lat.new_empty(q_lat.shape), q_lat, pages[..., :rank], pages[..., :rank], meta,
                                  self.scale, q2=q_rope, k2=pages[..., rank:], value_is_k1=True)
        return torch.einsum("thr,hvr->thv", out_lat, w_uv)
