"""Paged attention over torch's FlexAttention (`torch.nn.attention.flex_attention`), for full
attention, sliding windows, GQA and MLA (absorbed, over the latent cache), with the step's
decodes and prefill chunks in one flattened call.

The layer's cache is seen as one long KV sequence of pages; each query row is mapped to its
sequence and position, and the block mask, built from the block tables, lists per tile of
Q_BLOCK rows the pages those rows' sequences may read (`tile_pages`, from one row per sequence and
tile: its cost grows with the step's table width and sequences, not with the cache or a chunk's rows):

    cache [num_pages, bs, Hkv, D]  ->  kv [1, Hkv, num_pages * bs, D]    (a view, no copy)
    kv index n  ->  page n // bs, slot n % bs;  page p holds positions col[p] * bs + slot
    row m (seq s, position q) sees n  iff  table[s, col[p]] == p  and  key_start[s] <= pos <= q
                                           (and pos > q - window for a sliding layer)

A physical page sits at one logical column in every table that holds it (prefix-cache blocks
are shared at the same position), so `col` is well defined; the null block (page 0) is never
read. The whole tail of a page in the mask is loaded and given weight zero by the mask, not
skipped: 0 * NaN = NaN, so reads_unwritten_slots = True and new blocks must be zeroed (C1).

Where it runs. On CUDA, `flex_attention` is compiled with torch.compile (one Triton kernel per
shape; tiles of Q_BLOCK rows by one page, so the block size must be at least 16). On CPU,
torch 2.13 runs it eagerly: the unfused math reference (called directly, see `_unfused_reference`)
that materialises the scores of every row against every KV position it is given and ignores
the block mask's sparsity (only its mask_mod counts). So on CPU the step's pages are first
gathered into a compact KV (each distinct page inside its sequences' [key_start, seq_len) range,
once), which keeps the cost to the pages in use and, like the GPU kernel, reads every slot of each
page it lists; a captured step (`meta.static_shapes`: a shape may not depend on the tables) reads
the whole cache there too. That path is for tests, not serving: torch's vmap of the mask costs ~0.1 s a call.

No host sync in forward on CUDA, and no value read from a host list: shapes come from the
metadata's tensors, everything else is tensor arithmetic on the cache's device (no boolean
indexing, .item() or .tolist()), computed once per step and group (meta.derived). So a decode
step can be captured as a CUDA graph and replayed with new metadata in the same tensors
(worker/cuda_graphs.py). The CUDA path is checked by blockserve/bench/gpu_check.py (parity,
C1 poison); CI has no GPU, so its tests run the CPU path.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from blockserve.attention import kv_quant, latent_quant
from blockserve.attention.absorbed_mla import AbsorbedMLA
from blockserve.attention.metadata import AttentionMetadata, int64_tensor

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
except ImportError as error:  # an old torch: the backend is unavailable, the rest of blockserve is not
    AuxRequest = BlockMask = flex_attention = None
    FLEX_UNAVAILABLE: str | None = f"torch {torch.__version__} has no FlexAttention ({error})"
else:
    FLEX_UNAVAILABLE = None

Q_BLOCK = 16  # query rows per block-mask tile
MIN_CUDA_BLOCK_SIZE = 16  # the Triton kernel's smallest KV tile; one page is one tile
CUDA_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_BLOCK, "BLOCK_N": MIN_CUDA_BLOCK_SIZE}
# Graphs one process may compile: one per model shape, window, block size and dtype it serves
# (torch's default of 8 is too few for several models in one process, as blockserve/bench/gpu_check.py runs).
RECOMPILE_LIMIT = 64


@dataclass(frozen=True)
class _StepMask:
    """What every layer of a group reads in one step: the pages to pass as KV (None: the whole
    cache) and the block mask over them."""

    pages: torch.Tensor | None
    block_mask: object


@functools.cache
def compiled_flex(backend: str = "inductor") -> Callable:
    """attend(q, k, v, block_mask, scale) through torch.compile(flex_attention) with `backend`,
    built on first use: one graph (fullgraph); a size that changes is made dynamic on the recompile
    it causes, so a few kernels serve every batch and cache size (compiling costs seconds); the
    recompile limit is raised, and the scale kept a constant (not a dynamic float read back from
    a tensor), for this call only."""
    compiled = torch.compile(flex_attention, fullgraph=True, backend=backend)

    def attend(q, k, v, block_mask, scale, score_mod=None, return_aux=None):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, specialize_float=True):
            return compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, score_mod=score_mod,
                            kernel_options=CUDA_KERNEL_OPTIONS, return_aux=return_aux)

    return attend


@contextlib.contextmanager
def _unfused_reference():
    """Run flex_attention's unfused reference directly, without the Dynamo trace (with the eager
    backend) torch wraps it in by default: the same math, minus seconds of tracing per new shape.
    torch's own switch for it is a module flag; it is set only for the call and restored."""
    module = sys.modules[flex_attention.__module__]
    before = module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float,
            score_mod: Callable | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [1, Hq, T, E], k [1, Hkv, L, E], v [1, Hkv, L, Ev] -> [1, Hq, T, Ev]. With `sinks` [Hq], each
    head's sink logit joins the softmax's denominator: the output is scaled by
    exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), lse the row's log-sum-exp of scores."""
    if FLEX_UNAVAILABLE:
        raise RuntimeError(f"attention_backend 'flex' needs FlexAttention: {FLEX_UNAVAILABLE}")
    aux = None if sinks is None else AuxRequest(lse=True)
    if q.device.type == "cuda":
        out = compiled_flex()(q, k, v, block_mask, scale, score_mod, aux)
    else:
        with _unfused_reference():
            out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, score_mod=score_mod,
                                 return_aux=aux)
    if sinks is None:
        return out
    out, aux = out
    return out * torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None]).to(out.dtype)[..., None]


def soft_cap(softcap: float) -> Callable:
    """The score_mod of attention logit soft-capping: score -> softcap * tanh(score / softcap)."""

    def score_mod(score, b, h, m, n):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def tile_rows(query_start: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per tile of Q_BLOCK rows, the last row of each sequence in it: those rows (ascending), each
    one's place among its tile's, and the most any tile has. Such a row's needs hold those of its
    sequence's earlier rows in the tile (the same table and key_start, an earlier position), so a
    prefill chunk's tile needs one row, not Q_BLOCK."""
    rows = torch.zeros(query_start[-1], dtype=torch.bool)
    rows[Q_BLOCK - 1::Q_BLOCK] = True
    rows[int64_tensor(query_start[1:]) - 1] = True
    rows = rows.nonzero().flatten()
    tiles = rows // Q_BLOCK
    places = torch.arange(rows.shape[0]) - torch.searchsorted(tiles, tiles)
    return rows, places, int(places.max()) + 1


def tile_pages(row_pages: torch.Tensor, row_tile: torch.Tensor, row_place: torch.Tensor, num_tiles: int,
               rows_per_tile: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """row_pages [R, W]: the kv pages some query rows read (kv_len: none); row_tile, row_place [R]:
    each row's tile and place among that tile's rows (< rows_per_tile) -> (counts [num_tiles] int32,
    pages [num_tiles, N] int32): per tile its distinct pages, ascending, in the first `count` columns.
    N = min(rows_per_tile * W, kv_len): sized by the rows given, not by the cache. No shape depends on
    a value, so a captured step can build it."""
    width, device = row_pages.shape[1], row_pages.device
    grid = torch.full((num_tiles, rows_per_tile, width), kv_len, dtype=torch.int32, device=device)
    grid[row_tile, row_place] = row_pages.to(torch.int32)
    ordered = grid.view(num_tiles, rows_per_tile * width).sort(dim=-1).values
    keep = ordered < kv_len
    keep[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    size = min(rows_per_tile * width, kv_len)
    column = torch.where(keep, keep.cumsum(-1) - 1, size)  # a kept page's place; the rest into a sink column
    pages = torch.zeros(num_tiles, size + 1, dtype=torch.int32, device=device)
    pages.scatter_(1, column, ordered)
    return keep.sum(-1, dtype=torch.int32), pages[:, :size]


def step_mask(meta: AttentionMetadata, num_pages: int, device: torch.device, compact: bool) -> _StepMask:
    """The block mask of this step's rows over a cache of `num_pages` pages (see the module
    docstring), and with `compact` (CPU, not captured) the compact page list it indexes."""
    layout, bs = meta.layout, meta.block_size
    if device.type == "cuda" and bs < MIN_CUDA_BLOCK_SIZE:
        raise ValueError(f"attention_backend 'flex' on CUDA needs block_size >= {MIN_CUDA_BLOCK_SIZE} "
                         f"(one page per kernel tile); got {bs}")
    table = meta.block_table.to(device)
    seq = layout.seq_of_token.to(device)
    query_pos = layout.positions.to(device)
    key_start = meta.key_start.to(device)[seq]
    rows, width = query_pos.shape[0], table.shape[1]
    cols = torch.arange(width, device=device).expand_as(table)
    # A table's entries outside [key_start, seq_len) of its sequence may be stale ids (blocks since
    # freed, perhaps handed to another sequence at another column): only the entries inside count.
    last_col = (meta.seq_len.to(device) - 1) // bs
    in_range = (cols >= (meta.key_start.to(device) // bs)[:, None]) & (cols <= last_col[:, None])
    pages = None
    if compact:
        pages = torch.unique(table[in_range])  # sorted
        kv_page, kv_len = pages, pages.shape[0]
        position_in_kv = torch.searchsorted(pages, table).clamp_(max=kv_len - 1)  # exact where in_range
    else:
        kv_page, kv_len = torch.arange(num_pages, device=device), num_pages
        position_in_kv = table
    col = torch.full((kv_len + 1,), -1, dtype=torch.int64, device=device)  # the last: a sink for the rest
    col.scatter_(0, torch.where(in_range, position_in_kv, kv_len).flatten(), torch.where(in_range, cols, -1).flatten())
    col = col[:kv_len]
    col.masked_fill_(kv_page == 0, -1)  # the null block pads tables and replaces released blocks: never a key

    # Block sparsity: the pages some rows need (kv_len where none; tile_rows' rows, or in a captured
    # step, which has one row a sequence, all), merged per tile of Q_BLOCK rows.
    if meta.static_shapes or layout.num_decodes == layout.num_seqs:
        picked = torch.arange(rows, device=device)
        place, rows_per_tile = picked % Q_BLOCK, Q_BLOCK
    else:
        picked, place, rows_per_tile = meta.derive("flex_tile_rows", lambda host: tile_rows(host.layout.query_start))
    picked_seq = seq[picked]
    picked_cols = cols[:1].expand(picked.shape[0], -1)  # needed below lies inside in_range
    needed = ((picked_cols >= (key_start[picked] // bs)[:, None]) & (picked_cols <= (query_pos[picked] // bs)[:, None])
              & (table[picked_seq] != 0))
    kv_num_blocks, kv_indices = tile_pages(torch.where(needed, position_in_kv[picked_seq], kv_len), picked // Q_BLOCK,
                                           place, -(-rows // Q_BLOCK), rows_per_tile, kv_len)

    window = meta.sliding_window

    def mask_mod(b, h, m, n):
        page = n // bs
        c = col[page]
        pos = c * bs + n % bs
        s = seq[m]
        visible = (c >= 0) & (table[s, c.clamp(min=0)] == kv_page[page])
        visible = visible & (pos >= key_start[m]) & (pos <= query_pos[m])
        if window is not None:
            visible = visible & (pos > query_pos[m] - window)
        return visible

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks[None, None], kv_indices[None, None], BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
        seq_lengths=(rows, kv_len * bs), compute_q_blocks=False)
    return _StepMask(pages, block_mask)


def _kv(cache: torch.Tensor, pages: torch.Tensor | None) -> torch.Tensor:
    """A layer's cache [num_pages, bs, *rest] as one KV sequence [1, heads, L, dim] (rest: [heads,
    dim], or [dim] for the one shared head of MLA): a view of the whole cache, or on CPU a copy
    of the step's pages."""
    if pages is not None:
        cache = cache.index_select(0, pages)
    flat = cache.flatten(0, 1)  # [L, *rest]
    if flat.dim() == 2:
        flat = flat[:, None]
    return flat.transpose(0, 1)[None]


def _derived_mask(meta: AttentionMetadata, num_pages: int, device: torch.device) -> _StepMask:
    key = ("flex", num_pages, device)
    if key not in meta.derived:
        # Eager FlexAttention on the CPU reads every position it is given; a captured step's shapes may not
        # depend on the tables.
        meta.derived[key] = step_mask(meta, num_pages, device, device.type == "cpu" and not meta.static_shapes)
    return meta.derived[key]


class FlexAttention:
    """The paged-attention backend `flex` (same forward contract as paged_attention.PagedAttention):
    writes the step's K/V into the cache, then attends every row in one FlexAttention call
    (soft-capping the scores, as a score_mod, when `softcap` is set; with the sink logits forward
    receives when `sinks` is set)."""

    name: ClassVar[str] = "flex"
    reads_unwritten_slots: ClassVar[bool] = True
    captures_decode: ClassVar[bool] = True  # reads no host list (see the module docstring)
    quantized_kv_dtypes: ClassVar[tuple[str, ...]] = ("int8", "float8_e4m3fn", "int4_rotated")  # dequantised as read

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        """Why this backend cannot run on `device` (None: it can)."""
        return FLEX_UNAVAILABLE

    def __init__(self, scale: float, softcap: float | None = None, sinks: bool = False):
        self.scale = scale
        self.softcap = softcap
        self.sinks = sinks
        self.score_mod = None if softcap is None else soft_cap(softcap)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [num_pages, bs, Hkv, D], sinks [Hq] (exactly when built
        with sinks=True) -> [T, Hq, D]."""
        if (sinks is not None) != self.sinks:
            raise ValueError(f"attention backend built with sinks={self.sinks} but called with"
                             f"{'out' if sinks is None else ''} sink logits")
        if kv_quant.is_rotated(k_cache):  # the 4-bit form: R q attends R k (and R v gives R o, un-rotated once)
            q = kv_quant.rotate_queries(q)
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        kv_quant.write(k_flat, meta.slot_mapping, k, q)
        kv_quant.write(v_flat, meta.slot_mapping, v)
        mask = _derived_mask(meta, k_cache.shape[0], q.device)
        keys = kv_quant.decode(_kv(k_cache, mask.pages), q.dtype)
        values = kv_quant.decode(_kv(v_cache, mask.pages), q.dtype)
        out = _attend(q.transpose(0, 1)[None], keys, values, mask.block_mask, self.scale, self.score_mod, sinks)
        out = out[0].transpose(0, 1).contiguous()
        return kv_quant.unrotate_output(out) if kv_quant.is_rotated(v_cache) else out


class FlexMLA(AbsorbedMLA):
    """The MLA backend `flex`: the absorbed form (absorbed_mla.py) as one FlexAttention call in which
    all query heads share one KV head (GQA with Hkv = 1); FlexAttention allows the value width R to
    differ from the query/key width R + Dr."""

    name: ClassVar[str] = "flex"
    reads_unwritten_slots: ClassVar[bool] = True
    captures_decode: ClassVar[bool] = True  # reads no host list (see the module docstring)
    quantized_kv_dtypes: ClassVar[tuple[str, ...]] = ("int8", "float8_e4m3fn")  # pages dequantised as read

    def _attend_latent(self, q_lat, q_rope, cache, meta: AttentionMetadata) -> torch.Tensor:
        mask = _derived_mask(meta, cache.shape[0], q_lat.device)
        rank = q_lat.shape[-1]
        rows = latent_quant.decode(_kv(cache, mask.pages), rank, q_lat.dtype)  # [1, 1, L, R + Dr]
        query = torch.cat([q_lat, q_rope], dim=-1).transpose(0, 1)[None]  # [1, H, T, R + Dr]
        return _attend(query, rows, rows[..., :rank], mask.block_mask, self.scale)[0].transpose(0, 1)
