"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi Linear) over a paged latent cache.

The cache holds, per token, the normalised compressed KV `c` and the (rotated) shared rope key;
one MLASpec group, one tensor row per token:

    cache [num_blocks, block_size, R + Dr]     row = [ c (kv_lora_rank R) | k_rope (Dr) ]

or, with an int8 / fp8 kv_cache_dtype, each part as one-byte codes with its own float16 scale
(latent_quant.py: rows of R + Dr + 4 bytes). Every backend writes the codes in the step that writes
the latent and attends the dequantised rows (a fresh prompt too, so a prefix hit and a cold prompt
attend the same values); the triton kernel reads the codes in place, the others dequantise the rows
they gather.

kv_b_proj's rows for head h are W_UK_h [Dn, R] then W_UV_h [Dv, R]: k_nope_h = W_UK_h c and
v_h = W_UV_h c. A query head is [q_nope_h (Dn) | q_rope_h (Dr)].

    expanded (prefill)  k_h = [W_UK_h c | k_rope], v_h = W_UV_h c: ordinary attention with head
                        dim Dn + Dr and value dim Dv (cheap when there are many queries)
    absorbed (decode)   q_lat_h = W_UK_h^T q_nope_h; scores = [q_lat_h | q_rope_h] . row;
                        out_h = W_UV_h (sum_t p_t c_t): one shared "head" of width R + Dr,
                        never expanding the cache (cheap when there is one query per sequence)

Both are the same function of the cache (equal up to rounding). The two flavours differ only in
which cache rows they read (C1), as paged_attention.py's backends do:

    exact length   gathers exactly the rows of positions [0, seq_len) of each sequence; padding
                   reads row 0 of the null block, which is always zero.
                   reads_unwritten_slots = False: safe on recycled blocks without zeroing.
    whole block    gathers every row of every block a sequence touches (one index per block,
                   as FlashMLA reads pages) and gives the rows past seq_len softmax weight zero
                   instead of slicing them off: 0 * NaN = NaN, so an unzeroed tail holding NaN
                   poisons the output. reads_unwritten_slots = True.

Both flavours run equally fast, bound by gathering the latent rows (measured in
docs/performance.md). So the default is the exact flavour (the engine's default
attention_backend "exact"): its blocks need no zeroing.
attention_backend="whole_block" selects the other, which mirrors FlashMLA's page reads.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention import latent_quant
from blockserve.attention.context import ForwardContext
from blockserve.attention.flex_attention import FlexMLA
from blockserve.attention.layer import backend_graph_blocker, dtype_name
from blockserve.attention.metadata import AttentionMetadata
from blockserve.attention.triton_attention import TritonMLA
from blockserve.kv.specs import MLASpec


class MLABackend:
    """forward(q_nope [T, H, Dn], q_rope [T, H, Dr], latent [T, R], k_rope [T, Dr], w_uk [H, Dn, R],
    w_uv [H, Dv, R], cache [N, bs, row], meta) -> [T, H, Dv]. Writes the step's rows first (quantized
    when the cache is: latent_quant.py), then attends the rows as stored, dequantised once gathered."""

    name: ClassVar[str]
    reads_unwritten_slots: ClassVar[bool]
    captures_decode: ClassVar[bool] = False  # they build their gathers from the host lists
    # the quantized latent dtypes (kv/specs.py MLA_QUANTIZED_DTYPES) read: gathered rows are dequantised
    quantized_kv_dtypes: ClassVar[tuple[str, ...]] = ("int8", "float8_e4m3fn")

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, q_nope, q_rope, latent, k_rope, w_uk, w_uv, cache, meta: AttentionMetadata) -> torch.Tensor:
        rank = latent.shape[-1]
        rows_in = latent_quant.write(cache.view(-1, cache.shape[-1]), meta.slot_mapping, latent, k_rope)
        if cache.dtype != q_nope.dtype:  # attend what the cache holds, cold or warm (quantized or narrower)
            latent, k_rope = latent_quant.decode(rows_in, rank, q_nope.dtype).split([rank, k_rope.shape[-1]], -1)
        layout = meta.layout
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
        nd = layout.num_decodes
        if nd:
            index, mask = self._derived(meta, "decode", lambda host: self._decode_indices(host, nd))
            rows = latent_quant.decode(self._read(cache, index), rank, q_nope.dtype)  # [nd, L, R + Dr]
            q_lat = torch.einsum("thd,hdr->thr", q_nope[:nd], w_uk)
            scores = torch.bmm(torch.cat([q_lat, q_rope[:nd]], dim=-1), rows.transpose(1, 2)) * self.scale
            probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)  # [nd, H, L]
            out_lat = torch.bmm(probs, rows[..., :rank])  # a zero weight times a NaN row is NaN
            out[:nd] = torch.einsum("thr,hvr->thv", out_lat, w_uv)
        for i in range(nd, layout.num_seqs):
            start, end = layout.query_start[i], layout.query_start[i + 1]
            q = torch.cat([q_nope[start:end], q_rope[start:end]], dim=-1).transpose(0, 1)  # [H, n, Dn + Dr]
            if layout.seq_lens[i] == end - start:  # a whole fresh prompt: its own rows, no cache read
                k, v = _expand(latent[start:end], k_rope[start:end], w_uk, w_uv)
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
                out[start:end] = attn.transpose(0, 1)
                continue
            index, mask = self._derived(meta, i, lambda host: self._prefill_indices(host, i, end - start))
            rows = latent_quant.decode(self._read(cache, index)[0], rank, q_nope.dtype)
            k, v = _expand(rows[:, :rank], rows[:, rank:], w_uk, w_uv)
            probs = (q @ k.transpose(1, 2) * self.scale).masked_fill_(~mask, float("-inf")).softmax(dim=-1)
            out[start:end] = (probs @ v).transpose(0, 1)
        return out

    def _derived(self, meta: AttentionMetadata, key, compute):
        """Per step and group the gather indices are the same for every layer: computed once, from
        the host metadata (compute(host meta)), and moved to the device once."""
        return meta.derive(("mla", self.name, key), compute)

    def _decode_indices(self, meta: AttentionMetadata, nd: int):
        """(index, mask [nd, 1, L]: rows before each seq_len) for the step's decodes."""
        seq_lens = torch.tensor(meta.layout.seq_lens[:nd])
        index, key_pos = self._indices(meta, list(range(nd)))
        return index, (key_pos < seq_lens[:, None])[:, None, :]

    def _prefill_indices(self, meta: AttentionMetadata, i: int, n: int):
        """(index, causal mask [n, L], which also excludes rows at or past seq_len) for chunk i."""
        seq_len = meta.layout.seq_lens[i]
        index, key_pos = self._indices(meta, [i])
        return index, key_pos[0][None] <= torch.arange(seq_len - n, seq_len)[:, None]

    def _indices(self, meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(what `_read` takes, the position of each row read [N, L]) for sequences `seqs` (batch
        indices), from host metadata (shapes from its lists)."""
        raise NotImplementedError

    def _read(self, cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The rows [N, L, row] that `index` names, as stored."""
        raise NotImplementedError


def _expand(c: torch.Tensor, k_rope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor):
    """Latent rows c [L, R], k_rope [L, Dr] -> keys [H, L, Dn + Dr], values [H, L, Dv]."""
    k_nope = torch.einsum("lr,hdr->hld", c, w_uk)
    keys = torch.cat([k_nope, k_rope[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
    return keys, torch.einsum("lr,hvr->hlv", c, w_uv)


class ExactLengthMLA(MLABackend):
    """Reads only written rows: one index per token, rows past seq_len read row 0 of the null block."""

    name = "exact"
    reads_unwritten_slots = False

    def _indices(self, meta, seqs):
        bs = meta.block_size
        length = max(meta.layout.seq_lens[i] for i in seqs)
        seq_lens = torch.tensor([meta.layout.seq_lens[i] for i in seqs], dtype=torch.int64)
        seqs = torch.tensor(seqs, dtype=torch.int64)
        blocks = meta.block_table[seqs, : -(-length // bs)]  # [N, cols]: may run past a table's end
        slots = (blocks[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :length]
        key_pos = torch.arange(length)[None].expand(len(seqs), -1)
        return slots.masked_fill_(key_pos >= seq_lens[:, None], 0), key_pos  # unwritten: null row 0

    def _read(self, cache, index):
        return cache.view(-1, cache.shape[-1])[index]


class WholeBlockMLA(MLABackend):
    """Reads whole blocks, one index per block; the unwritten tail of the last is weighted by zero."""

    name = "whole_block"
    reads_unwritten_slots = True

    def _indices(self, meta, seqs):
        bs = meta.block_size
        seq_lens = torch.tensor([meta.layout.seq_lens[i] for i in seqs], dtype=torch.int64)
        num_blocks = (seq_lens + bs - 1) // bs
        count = max(-(-meta.layout.seq_lens[i] // bs) for i in seqs)
        seqs = torch.tensor(seqs, dtype=torch.int64)
        cols = torch.arange(count)[None].expand(len(seqs), -1)
        in_table = cols < num_blocks[:, None]  # past a table's end the row may hold stale ids
        blocks = torch.where(in_table, meta.block_table[seqs[:, None], cols], 0)
        key_pos = torch.arange(blocks.shape[1] * bs)[None].expand(len(seqs), -1)
        return blocks, key_pos

    def _read(self, cache, index):
        return cache[index].flatten(1, 2)  # [N, blocks * bs, R + Dr]


MLA_BACKENDS: dict[str, type[MLABackend]] = {cls.name: cls for cls in (ExactLengthMLA, WholeBlockMLA, FlexMLA,
                                                                                     TritonMLA)}


class MLAttention(nn.Module):
    """The MLA layer a model instantiates for layer `layer_name`: it owns no weights, only the
    paged latent cache's read/write, rows of kv_lora_rank + qk_rope_head_dim in `dtype` (the
    model's; the engine's kv_cache_dtype may store them quantized instead). The model passes
    kv_b_proj's weight, split here per head.

    forward(q [T, H, Dn + Dr] (rope applied), latent [T, R] (normalised), k_rope [T, Dr] (rope
    applied), kv_b_weight [H * (Dn + Dv), R], ctx) -> [T, H * Dv]
    """

    def __init__(self, layer_name: str, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                 backend: MLABackend, *, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.backend = backend
        self.kv_lora_rank, self.qk_rope_head_dim, self.dtype = kv_lora_rank, qk_rope_head_dim, dtype

    @property
    def reads_unwritten_slots(self) -> bool:
        """C1: declared by the backend; the engine derives its group's zero flag from it."""
        return self.backend.reads_unwritten_slots

    def cuda_graph_blocker(self) -> str | None:
        """Why a decode step through this layer cannot be captured as a CUDA graph (None: it can)."""
        return backend_graph_blocker(self.backend)

    def kv_cache_spec(self, block_size: int) -> MLASpec:
        return MLASpec(block_size, self.kv_lora_rank, self.qk_rope_head_dim, dtype_name(self.dtype))

    def forward(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, kv_b_weight: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        cache, meta = ctx.for_layer(self.layer_name)
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        dn = self.qk_nope_head_dim
        out = self.backend.forward(q[..., :dn], q[..., dn:], latent, k_rope, w[:, :dn], w[:, dn:],
                                   cache.cache, meta)
        return out.reshape(q.shape[0], self.num_heads * self.v_head_dim)

