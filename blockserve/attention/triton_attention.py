"""The `triton` backends: paged attention and MLA through our own Triton kernel (triton_paged.py),
every row of a step (decodes and prefill chunks) in one launch per layer.

    attention   q [T, Hq, D] over the pages of k_cache / v_cache [N, bs, Hkv, D]
    MLA         absorbed (absorbed_mla.py): [W_UK_h^T q_nope_h | q_rope_h] over the latent rows
                [c | k_rope] of cache [N, bs, R + Dr], one KV head shared by all query heads,
                values c

Quantized caches (kv_quant.py: int8, fp8, rotated 4-bit, and one-byte keys over 4-bit values) are
written as codes and scales by kv_quant.write and read in place by the kernel; over a 4-bit cache the
queries are rotated before the kernel and the output un-rotated after it, as the other backends do.
MLA's int8 and fp8 latent caches (latent_quant.py) are read in place the same way, each row's latent
and rope key with its own scale.

Attention sinks (GPT-OSS): with `sinks=True` forward takes each head's sink logit and the kernel adds
it to the softmax's denominator. The kernel reads only slots its rows may see (masked page loads; a
quantized row's scale too), so reads_unwritten_slots = False: recycled blocks need no zeroing (C1),
plain or quantized. It reads no host list, so decode steps are captured as CUDA graphs. On the CPU
it runs in Triton's interpreter, for tests (TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from blockserve.attention import kv_quant, latent_quant, triton_paged
from blockserve.attention.absorbed_mla import AbsorbedMLA
from blockserve.attention.metadata import AttentionMetadata


class TritonAttention:
    """The paged-attention backend `triton` (same forward contract as paged_attention.PagedAttention)."""

    name: ClassVar[str] = "triton"
    reads_unwritten_slots: ClassVar[bool] = False  # page loads are masked to written slots
    captures_decode: ClassVar[bool] = True  # reads no host list
    # read in place (codes widened, scales folded in registers); loads of codes and scales alike are masked
    quantized_kv_dtypes: ClassVar[tuple[str, ...]] = ("int8", "float8_e4m3fn", "int4_rotated")

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        """Why this backend cannot run on `device` (None: it can)."""
        return triton_paged.unavailable(device)

    @staticmethod
    def unreadable_kv_dtype(dtype: str, device: torch.device) -> str | None:
        """Why a dtype of quantized_kv_dtypes cannot be read on `device` (None: it can): fp8 on a
        GPU older than sm_89. The engine refuses it at start-up (engine/core.py)."""
        return triton_paged.fp8_unavailable(device) if dtype == "float8_e4m3fn" else None

    def __init__(self, scale: float, softcap: float | None = None, sinks: bool = False):
        if softcap is not None:
            raise ValueError(f"attention_backend 'triton' does not soft-cap attention scores (softcap={softcap}); "
                             "serve this model with attention_backend 'flex', 'exact' or 'whole_block'")
        self.scale = scale
        self.softcap = None
        self.sinks = sinks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [num_pages, bs, Hkv, D], sinks [Hq] (exactly when built
        with sinks=True) -> [T, Hq, D]."""
        if (sinks is not None) != self.sinks:
            raise ValueError(f"attention backend built with sinks={self.sinks} but called with"
                             f"{'out' if sinks is None else ''} sink logits")
        if kv_quant.is_rotated(k_cache):  # the 4-bit form: R q attends R k (and R v gives R o, un-rotated once)
            q = kv_quant.rotate_queries(q)
        kv_quant.write(k_cache.view(-1, *k_cache.shape[2:]), meta.slot_mapping, k, q)  # codes and scales when quantized
        kv_quant.write(v_cache.view(-1, *v_cache.shape[2:]), meta.slot_mapping, v)
        out = triton_paged.paged_attention(q.new_empty(q.shape), q, k_cache, v_cache, meta, self.scale, sinks=sinks)
        return kv_quant.unrotate_output(out) if kv_quant.is_rotated(v_cache) else out


class TritonMLA(AbsorbedMLA):
    """The MLA backend `triton`: the absorbed form (absorbed_mla.py) as one kernel launch whose keys
    come in two parts, [c | k_rope], and whose values are the first (read once). A quantized latent
    cache (latent_quant.py) is read in place: each part's codes, with its own scale."""

    name: ClassVar[str] = "triton"
    reads_unwritten_slots: ClassVar[bool] = False
    captures_decode: ClassVar[bool] = True
    quantized_kv_dtypes: ClassVar[tuple[str, ...]] = ("int8", "float8_e4m3fn")  # scale loads masked as the codes'
    unreadable_kv_dtype = staticmethod(TritonAttention.unreadable_kv_dtype)

    def _attend_latent(self, q_lat, q_rope, cache, meta: AttentionMetadata) -> torch.Tensor:
        rank, rope = q_lat.shape[-1], q_rope.shape[-1]
        pages = cache[:, :, None]  # [N, bs, 1, row]: one KV head
        latent, k_rope = pages[..., :rank], pages[..., rank:rank + rope]
        scales = latent_quant.scales(pages) if latent_quant.is_quantized(cache) else None
        return triton_paged.paged_attention(q_lat.new_empty(q_lat.shape), q_lat, latent, latent, meta, self.scale,
                                            q2=q_rope, k2=k_rope, value_is_k1=True, key_scales=scales)
