"""MLA in the absorbed form for every row, prefill or decode, over the latent cache: the shape of
the kernel backends (flex, triton) whose attention takes a value width different from the
query/key width, so the cache is never expanded:

    q_h = [W_UK_h^T q_nope_h | q_rope_h]   k = row = [c | k_rope]   v = c
    out_h = W_UV_h (softmax(q_h . k) v)

All query heads share one KV head (the latent row) of width R + Dr and value width R. This is the
same function of the cache as mla.py's flavours (up to rounding); prefill pays the absorbed form's
wider dot products instead of expanding the cache.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from blockserve.attention import latent_quant
from blockserve.attention.metadata import AttentionMetadata


class AbsorbedMLA:
    """An MLA backend (mla.MLABackend's forward contract) that writes the step's latent rows, then
    attends in the absorbed form through `_attend_latent`, which subclasses give."""

    name: ClassVar[str]
    reads_unwritten_slots: ClassVar[bool]
    captures_decode: ClassVar[bool]

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, q_nope, q_rope, latent, k_rope, w_uk, w_uv, cache, meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T, H, Dn], q_rope [T, H, Dr], latent [T, R], k_rope [T, Dr], w_uk [H, Dn, R],
        w_uv [H, Dv, R], cache [num_pages, bs, row] -> [T, H, Dv]. The rows are written quantized when
        the cache is (latent_quant.py)."""
        latent_quant.write(cache.view(-1, cache.shape[-1]), meta.slot_mapping, latent, k_rope)
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        out_lat = self._attend_latent(q_lat, q_rope, cache, meta)
        return torch.einsum("thr,hvr->thv", out_lat, w_uv)

    def _attend_latent(self, q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """q_lat [T, H, R], q_rope [T, H, Dr] over the latent rows of cache [N, bs, row] (plain or
        quantized) -> [T, H, R]."""
        raise NotImplementedError
