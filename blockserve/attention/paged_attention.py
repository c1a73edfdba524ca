"""CPU paged attention over a block-structured KV cache, in two flavours (C1).

Both write the step's K/V into the cache first, then attend each query to the keys its
sequence may see. They differ only in which cache slots they read:

    exact length   gathers exactly the slots of positions [key_start, seq_len) of each
                   sequence; padding reads slot 0 of the null block, which is always zero.
                   reads_unwritten_slots = False: safe on recycled blocks without zeroing.
    whole block    gathers every slot of each block the sequence's keys touch, and masks the
                   positions past seq_len by weight zero. The unwritten tail of the last block
                   is read: 0 * NaN = NaN, so its blocks must be zeroed when allocated.
                   reads_unwritten_slots = True.

    block table row  [b7 ][b2 ][b9 ]         seq_len = 10, block_size = 4
    exact reads      b7:0-3 b2:0-3 b9:0-1
    whole block      b7:0-3 b2:0-3 b9:0-3    (b9:2-3 unwritten, weighted by zero)

Decodes are attended together in one batched call (exact length: by the native kernel of
csrc/paged_decode.cpp when it is built, which reads the same slots in place instead of copying
them); prefill chunks one sequence at a time (a fresh prompt needs no cache read at all).

A quantized cache (int8, fp8 or rotated 4-bit, attention/kv_quant.py) is written as codes and scales, and every read
dequantises; a fresh prompt then attends the dequantised K/V too, so that a prefix-cache hit
and a cold run see the same values (C4).

Attention logit soft-capping (`softcap`, Gemma 2): scores become softcap * tanh(scores / softcap)
before the mask and softmax, computed explicitly (scaled_dot_product_attention has no such hook);
the native decode kernel does not soft-cap, so a soft-capping backend never uses it.

Attention sinks (`sinks=True`, GPT-OSS): each query head h has a learned logit sinks[h] that joins
the softmax's denominator and weights no value,

    out = Σ_k exp(s_k) v_k / (exp(sinks[h]) + Σ_k exp(s_k)),

computed explicitly too, and by the native decode kernel (its `sinks` argument). The sink logits
arrive with each forward (they are the model's weights).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from blockserve.attention import kv_quant
from blockserve.attention.flex_attention import FlexAttention
from blockserve.attention.metadata import AttentionMetadata
from blockserve.native.extension import paged_decode_kernel
from blockserve.native.gate import native_reads
from blockserve.attention.triton_attention import TritonAttention

DECODE_BUCKETS = 4  # length buckets the decodes of a step are split into
MIN_BUCKET = 8  # decodes per bucket at least, so small batches stay one call


class _Gather(NamedTuple):
    """What a group of sequences reads: [N, L] key positions and validity, and either the slot
    of each key (exact length) or the [N, L / block_size] blocks holding them (whole block)."""

    key_pos: torch.Tensor
    valid: torch.Tensor
    slots: torch.Tensor | None = None
    blocks: torch.Tensor | None = None

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """The gathered keys or values [N, L, Hkv, D] from a layer's cache [num_blocks, bs, Hkv, D].
        (index_select: about twice as fast as advanced indexing for this on CPU.)"""
        n, heads, dim = self.key_pos.shape[0], cache.shape[2], cache.shape[3]
        if self.blocks is not None:
            return cache.index_select(0, self.blocks.flatten()).view(n, -1, heads, dim)
        return cache.view(-1, heads, dim).index_select(0, self.slots.flatten()).view(n, -1, heads, dim)


def explicit_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(mask(softcap * tanh(q kᵀ * scale / softcap))) v, the softmax in float32 (as transformers'
    eager attention); without `softcap` the scores are q kᵀ * scale; with `sinks` [Hq] each head's sink
    logit joins the softmax as a key with no value. q [N, Hq, n, D]; keys, values [N, Hkv, L, D];
    mask (True: attend) broadcastable to [N, Hq, n, L]."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights.to(q.dtype), values)


class PagedAttention:
    name: ClassVar[str]
    reads_unwritten_slots: ClassVar[bool]
    # The quantized KV dtypes (kv/specs.py QUANTIZED_KV_DTYPES) this backend reads and writes.
    quantized_kv_dtypes: ClassVar[tuple[str, ...]] = ("int8", "float8_e4m3fn", "int4_rotated")
    # Whether a decode step's forward may be captured as a CUDA graph (worker/cuda_graphs.py): it
    # reads only tensors, no host list. These backends build their gathers from the host lists.
    captures_decode: ClassVar[bool] = False

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        """Why this backend cannot run on `device` (None: it can). These run anywhere."""
        return None

    def __init__(self, scale: float, softcap: float | None = None, sinks: bool = False):
        self.scale = scale
        self.softcap = softcap
        self.sinks = sinks  # whether forward receives each head's sink logit

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [Hq]: given exactly when the backend was built with sinks=True
    ) -> torch.Tensor:
        if (sinks is not None) != self.sinks:
            raise ValueError(f"attention backend built with sinks={self.sinks} but called with"
                             f"{'out' if sinks is None else ''} sink logits")
        if kv_quant.is_rotated(k_cache):  # the 4-bit form: R q attends R k (and R v gives R o, un-rotated once)
            q = kv_quant.rotate_queries(q)
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        k_rows = kv_quant.write(k_flat, meta.slot_mapping, k, q)  # slots are distinct within a step
        v_rows = kv_quant.write(v_flat, meta.slot_mapping, v)
        # Attend what the cache holds, cold or warm (C4: a prefix hit reads these rows): a quantized or
        # narrower cache's rows, not the step's own unrounded k and v.
        if k_cache.dtype != q.dtype:
            k = kv_quant.decode(k_rows, q.dtype)
        if v_cache.dtype != q.dtype:
            v = kv_quant.decode(v_rows, q.dtype)
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        layout = meta.layout
        nd = layout.num_decodes
        if nd:
            self._attend_decodes(q, k_cache, v_cache, meta, out, sinks)
        for i in range(nd, layout.num_seqs):
            start, end = layout.query_start[i], layout.query_start[i + 1]
            seq_len = layout.seq_lens[i]
            n = end - start
            qi = q[start:end].transpose(0, 1)[None]
            if seq_len == n and meta.sliding_window is None and self.softcap is None and sinks is None:  # no cache read
                out[start:end] = F.scaled_dot_product_attention(
                    qi, k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None],
                    is_causal=True, scale=self.scale, enable_gqa=True,
                )[0].transpose(0, 1)
                continue
            g, mask = self._derived(meta, i, lambda host: self._prefill_gather(host, i, seq_len, n))
            out[start:end] = self._attend(qi, g.read(k_cache), g.read(v_cache), mask, sinks)[0].transpose(0, 1)
        return kv_quant.unrotate_output(out) if kv_quant.is_rotated(v_cache) else out

    def _attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        """out[:num_decodes] = attention of the decodes' single queries, in length buckets."""
        for seqs, g in self._derived(meta, "decode", self._decode_buckets):
            mask = g.valid[:, None, None, :]
            out[seqs] = self._attend(q[seqs, :, None], g.read(k_cache), g.read(v_cache), mask, sinks)[:, :, 0]

    def _derived(self, meta: AttentionMetadata, key, compute):
        """Per step and group, gather indices are the same for every layer: computed once, from the
        host metadata (compute(host meta)), and moved to the device once."""
        return meta.derive((self.name, key), compute)

    def _decode_buckets(self, meta: AttentionMetadata) -> list[tuple[torch.Tensor, _Gather]]:
        """Decodes sorted by length in up to DECODE_BUCKETS groups, each padded only to its own
        longest context: less padding to copy and attend over than one batch padded to the
        longest of all (measured in docs/performance.md)."""
        nd = meta.layout.num_decodes
        if not nd:
            return []
        order = sorted(range(nd), key=meta.layout.seq_lens.__getitem__)
        count = min(DECODE_BUCKETS, max(1, nd // MIN_BUCKET))
        buckets = [order[i * nd // count : (i + 1) * nd // count] for i in range(count)]
        return [(torch.tensor(seqs, dtype=torch.int64), self._gather(meta, seqs)) for seqs in buckets]

    def _prefill_gather(self, meta: AttentionMetadata, i: int, seq_len: int, n: int) -> tuple[_Gather, torch.Tensor]:
        """Sequence i's context slots and its [1, 1, n, L] causal (and window) mask."""
        g = self._gather(meta, [i])
        query_pos = torch.arange(seq_len - n, seq_len)[:, None]
        mask = g.valid & (g.key_pos <= query_pos)  # [n, L]
        if meta.sliding_window is not None:
            mask &= g.key_pos > query_pos - meta.sliding_window
        return g, mask[None, None]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, Hq, n, D], keys/values [N, L, Hkv, D] (any cache dtype: computed in q's), mask
        broadcastable to [N, Hq, n, L], sinks [Hq] or None."""
        keys, values = kv_quant.decode(keys, q.dtype), kv_quant.decode(values, q.dtype)
        if self.softcap is not None or sinks is not None:
            return explicit_attention(q, keys.transpose(1, 2), values.transpose(1, 2), mask, self.scale,
                                      self.softcap, sinks)
        return F.scaled_dot_product_attention(
            q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=self.scale, enable_gqa=True
        )

    def _gather(self, meta: AttentionMetadata, seqs: list[int]) -> _Gather:
        """What sequences `seqs` (batch indices) read, from host metadata (shapes from its lists)."""
        raise NotImplementedError


class ExactLengthAttention(PagedAttention):
    """Decodes go to the native in-place kernel when it is built and reads this cache's dtype
    (native/extension.py; reads exactly the same slots, no copy), else to the gathered PyTorch path. Set
    `decode_kernel = None` to force the latter (a soft-capping backend always takes it)."""

    name = "exact"
    reads_unwritten_slots = False

    def __init__(self, scale: float, softcap: float | None = None, sinks: bool = False):
        super().__init__(scale, softcap, sinks)
        self.decode_kernel = paged_decode_kernel() if softcap is None else None  # the kernel does not soft-cap

    def _attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        if (self.decode_kernel is None or not native_reads(q, q.dtype)
                or not self.decode_kernel.reads(q.dtype, k_cache.dtype, q.shape[-1], v_cache.dtype)
                or (sinks is not None and (kv_quant.is_quantized(k_cache) or kv_quant.is_quantized(v_cache)))):
            # the sinks kernel reads float caches
            return super()._attend_decodes(q, k_cache, v_cache, meta, out, sinks)
        nd = meta.layout.num_decodes
        table, key_start, seq_lens = self._derived(meta, "decode_in_place", lambda host: (
            host.block_table[:nd].contiguous(), host.key_start[:nd].contiguous(), host.seq_len[:nd].contiguous()))
        decodes = out[:nd]
        self.decode_kernel(decodes, q[:nd].contiguous(), k_cache, v_cache, table, key_start, seq_lens, self.scale,
                           sinks=None if sinks is None else sinks.float().contiguous())

    def _gather(self, meta: AttentionMetadata, seqs: list[int]) -> _Gather:
        lens = meta.layout.seq_lens
        length = max(lens[i] - meta.key_starts[i] for i in seqs)
        seq_lens = torch.tensor([lens[i] for i in seqs], dtype=torch.int64)
        seqs = torch.tensor(seqs, dtype=torch.int64)
        start = meta.key_start[seqs]
        key_pos = start[:, None] + torch.arange(length)[None]
        valid = key_pos < seq_lens[:, None]
        bs = meta.block_size
        cols = torch.where(valid, key_pos // bs, 0)
        slots = meta.block_table[seqs[:, None], cols] * bs + key_pos % bs
        return _Gather(key_pos, valid, slots=torch.where(valid, slots, 0))


class WholeBlockAttention(PagedAttention):
    name = "whole_block"
    reads_unwritten_slots = True

    def _gather(self, meta: AttentionMetadata, seqs: list[int]) -> _Gather:
        bs, lens = meta.block_size, meta.layout.seq_lens
        count = max((lens[i] - 1) // bs - meta.key_starts[i] // bs for i in seqs) + 1
        seq_lens = torch.tensor([lens[i] for i in seqs], dtype=torch.int64)
        seqs = torch.tensor(seqs, dtype=torch.int64)
        first = meta.key_start[seqs] // bs
        last = (seq_lens - 1) // bs
        cols = first[:, None] + torch.arange(count)[None]
        in_table = cols <= last[:, None]
        blocks = torch.where(in_table, meta.block_table[seqs[:, None], torch.where(in_table, cols, 0)], 0)
        key_pos = (cols[:, :, None] * bs + torch.arange(bs)).flatten(1)
        valid = (key_pos >= meta.key_start[seqs][:, None]) & (key_pos < seq_lens[:, None]) & in_table.repeat_interleave(bs, 1)
        return _Gather(key_pos, valid, blocks=blocks)


BACKENDS: dict[str, type[PagedAttention]] = {cls.name: cls for cls in (ExactLengthAttention, WholeBlockAttention, FlexAttention,
                                                                   TritonAttention)}
