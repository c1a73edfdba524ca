"""A paged attention kernel of our own in Triton: every row of a step (decodes and prefill chunks,
flattened) attends to its sequence's pages in place, reading only the slots it may see.

One program handles a tile of up to BLOCK_Q consecutive query rows of one sequence for a block
of G_BLOCK query heads that share one KV head, as the rows of one matrix:

    tile rows   r = qi * G_BLOCK + g      query row (tile start + qi), head kv_head * G + g
    keys        positions lo..hi in steps of BLOCK_N (any number of pages: each key's page is
                looked up in the block table), one step of an online softmax each (fp32
                accumulators); lo = the first key any row of the tile sees (key_start, or the
                window), hi = the tile's last position
    loads       every table and K/V load is masked to positions [lo, hi]: a slot at or past
                seq_len (never written) is not read, so reads_unwritten_slots = False (C1)

Keys may come in two parts (`q2`/`k2`, dot products added): MLA's absorbed form scores a head
as [q_lat | q_rope] . [c | k_rope] over the latent cache row, and its values are the row's
first part (VALUE_IS_K1: the loaded page is reused, not read twice).

Shapes and where it runs: tl.dot needs every dimension >= 16, so head widths are padded to a
power of two >= 16 (masked) and tiles to >= 16 rows; a key step spans whole pages or part of one,
so any block size works. On CUDA the kernel is compiled by Triton for the device; on the CPU it runs in Triton's
interpreter (`InterpretedFunction`: numpy, slow: for tests). `compile_for` builds it for a GPU
target without one (ptxas ships with Triton), which is how CI checks that the CUDA build compiles.

No host sync and no host list: the tile map is computed with tensor ops from the metadata's
tensors and the grid from shapes alone, so a decode step can be captured as a CUDA graph.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from blockserve.attention.metadata import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError as error:  # the backend is unavailable, the rest of blockserve is not
    triton = tl = None
    TRITON_UNAVAILABLE: str | None = f"the triton package is not installed ({error}); pip install triton"
else:
    TRITON_UNAVAILABLE = None

MIN_DOT = 16  # tl.dot's smallest dimension
PREFILL_TILE = 16  # query rows per tile at most when a step has a prefill chunk (decode-only steps: one)
MAX_TILE_ELEMENTS = 16384  # tile rows x head width at most (MLA's 16 heads x 576: one query row per tile)
MAX_HEAD_BLOCK = 16  # query heads per program at most (MLA's 128 heads: 8 programs per row)
KEY_TILE = 64  # keys per step of the online softmax (half that for heads wider than WIDE_HEAD)
WIDE_HEAD = 256


def interpreting() -> bool:
    """Whether Triton was imported in interpreter mode (TRITON_INTERPRET=1 set before the import:
    its library functions are bound to one mode then, so a process runs kernels one way only)."""
    return TRITON_UNAVAILABLE is None and not isinstance(_KERNEL, triton.runtime.JITFunction)


def _pad(n: int) -> int:
    return max(MIN_DOT, 1 << max(0, n - 1).bit_length())


def _kernel(
    out_ptr, q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr,
    table_ptr, seq_len_ptr, key_start_ptr, query_start_ptr, tile_seq_ptr, tile_row_ptr,
    scale_log2e, window,
    stride_ot, stride_oh, stride_q1t, stride_q1h, stride_q2t, stride_q2h,
    stride_k1p, stride_k1s, stride_k1h, stride_k2p, stride_k2s, stride_k2h,
    stride_vp, stride_vs, stride_vh, stride_table,
    G: tl.constexpr, G_BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    D1: tl.constexpr, D1_PAD: tl.constexpr, D2: tl.constexpr, D2_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr, VALUE_IS_K1: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    head_block = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    if seq >= 0:
        row0 = tl.load(tile_row_ptr + tile)
        q_start = tl.load(query_start_ptr + seq)
        q_end = tl.load(query_start_ptr + seq + 1)
        seq_len = tl.load(seq_len_ptr + seq)
        first_pos = seq_len - (q_end - q_start) + (row0 - q_start)  # position of the tile's first row
        tile_len = tl.minimum(q_end - row0, BLOCK_Q)

        r = tl.arange(0, BLOCK_M)
        qi = r // G_BLOCK
        g = head_block * G_BLOCK + r % G_BLOCK
        row_ok = (qi < tile_len) & (g < G) & (r < BLOCK_Q * G_BLOCK)
        token = (row0 + qi).to(tl.int64)
        head = (kv_head * G + g).to(tl.int64)
        pos = first_pos + qi

        d1 = tl.arange(0, D1_PAD)
        q1 = tl.load(q1_ptr + token[:, None] * stride_q1t + head[:, None] * stride_q1h + d1[None, :],
                     mask=row_ok[:, None] & (d1[None, :] < D1), other=0.0)
        if D2 > 0:
            d2 = tl.arange(0, D2_PAD)
            q2 = tl.load(q2_ptr + token[:, None] * stride_q2t + head[:, None] * stride_q2h + d2[None, :],
                         mask=row_ok[:, None] & (d2[None, :] < D2), other=0.0)
        dv = tl.arange(0, DV_PAD)

        lo = tl.load(key_start_ptr + seq)
        if HAS_WINDOW:
            lo = tl.maximum(lo, first_pos - window + 1)
        hi = first_pos + tile_len - 1
        n = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
        for start in range(lo // BLOCK_N * BLOCK_N, hi + 1, BLOCK_N):
            key_pos = start + n
            readable = (key_pos >= lo) & (key_pos <= hi)  # written slots only (C1)
            page = tl.load(table_ptr + seq * stride_table + key_pos // PAGE, mask=readable, other=0).to(tl.int64)
            slot = key_pos % PAGE
            k1 = tl.load(k1_ptr + page[:, None] * stride_k1p + slot[:, None] * stride_k1s + kv_head * stride_k1h
                         + d1[None, :], mask=readable[:, None] & (d1[None, :] < D1), other=0.0)
            scores = tl.dot(q1, tl.trans(k1.to(q1.dtype)), input_precision=PRECISION)
            if D2 > 0:
                k2 = tl.load(k2_ptr + page[:, None] * stride_k2p + slot[:, None] * stride_k2s + kv_head * stride_k2h
                             + d2[None, :], mask=readable[:, None] & (d2[None, :] < D2), other=0.0)
                scores += tl.dot(q2, tl.trans(k2.to(q2.dtype)), input_precision=PRECISION)
            visible = row_ok[:, None] & readable[None, :] & (key_pos[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > pos[:, None] - window)
            scores = tl.where(visible, scores * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if VALUE_IS_K1:
                values = k1
            else:
                values = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh
                                 + dv[None, :], mask=readable[:, None] & (dv[None, :] < DV), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q1.dtype), values.to(q1.dtype), input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))


_KERNEL = None if TRITON_UNAVAILABLE else triton.jit(_kernel)  # interpreted when TRITON_INTERPRET=1


@dataclass(frozen=True)
class TileMap:
    """Which (sequence, first row) each program's tile is: `seq[t] = -1` for the grid's spare tiles.
    Built from the metadata's tensors only (no host value), on their device."""

    rows: int  # query rows per tile
    query_start: torch.Tensor  # [B + 1]
    seq: torch.Tensor  # [num_tiles] int32
    first_row: torch.Tensor  # [num_tiles] int64

    @staticmethod
    def build(meta: AttentionMetadata, rows: int) -> TileMap:
        num_seqs, num_tokens = meta.block_table.shape[0], meta.slot_mapping.shape[0]
        device = meta.slot_mapping.device
        seq_of_token = meta.layout.seq_of_token.to(device)
        query_len = torch.zeros(num_seqs, dtype=torch.int64, device=device).index_add_(
            0, seq_of_token, torch.ones_like(seq_of_token))
        query_start = torch.nn.functional.pad(query_len.cumsum(0), (1, 0))
        tiles = (query_len + rows - 1) // rows
        tile_end = tiles.cumsum(0)
        num_tiles = (num_tokens + num_seqs * (rows - 1)) // rows  # >= sum(tiles), from shapes alone
        index = torch.arange(num_tiles, device=device)
        seq = torch.searchsorted(tile_end, index, right=True)
        in_use = seq < num_seqs
        seq = seq.clamp(max=num_seqs - 1)
        first_row = query_start[seq] + (index - (tile_end[seq] - tiles[seq])) * rows
        return TileMap(rows, query_start, torch.where(in_use, seq, -1).to(torch.int32), first_row)


def tile_rows(meta: AttentionMetadata, heads_per_program: int, width: int) -> int:
    """Query rows per tile: one in a decode-only step (a shape fact, so the same in a captured graph),
    else up to PREFILL_TILE within MAX_TILE_ELEMENTS."""
    if meta.slot_mapping.shape[0] == meta.block_table.shape[0]:
        return 1
    return max(1, min(PREFILL_TILE, MAX_TILE_ELEMENTS // (heads_per_program * width)))


def tile_map(meta: AttentionMetadata, rows: int) -> TileMap:
    """The step's tile map, built by the group's first layer and reused by the others."""
    key = ("triton", "tiles", rows)
    if key not in meta.derived:
        meta.derived[key] = TileMap.build(meta, rows)
    return meta.derived[key]


def _launch_args(out, q1, q2, k1, k2, v, meta: AttentionMetadata, scale: float, value_is_k1: bool, tiles=tile_map):
    """(grid, positional args, constexpr kwargs, num_warps) of one launch. Caches are [pages, bs, heads, dim]."""
    num_kv_heads = k1.shape[2]
    group = q1.shape[1] // num_kv_heads
    head_block = min(1 << (group - 1).bit_length(), MAX_HEAD_BLOCK)
    if value_is_k1 and out.shape[-1] != k1.shape[-1]:
        raise ValueError(f"values read from k1 need out's width {out.shape[-1]} to be k1's {k1.shape[-1]}")
    d2 = 0 if q2 is None else q2.shape[-1]
    width = max(_pad(q1.shape[-1]) + (_pad(d2) if d2 else 0), _pad(out.shape[-1]))
    tiles = tiles(meta, tile_rows(meta, head_block, width))
    grid = (tiles.seq.shape[0], num_kv_heads, -(-group // head_block))
    q2 = q1 if q2 is None else q2
    k2 = k1 if k2 is None else k2
    window = meta.sliding_window
    args = (out, q1, q2, k1, k2, v, meta.block_table, meta.seq_len, meta.key_start, tiles.query_start,
            tiles.seq, tiles.first_row, scale * math.log2(math.e), window or 0,
            out.stride(0), out.stride(1), q1.stride(0), q1.stride(1), q2.stride(0), q2.stride(1),
            *k1.stride()[:3], *k2.stride()[:3], *v.stride()[:3], meta.block_table.stride(0))
    constexprs = dict(
        G=group, G_BLOCK=head_block, BLOCK_Q=tiles.rows, BLOCK_M=max(MIN_DOT, tiles.rows * head_block),
        BLOCK_N=KEY_TILE if width <= WIDE_HEAD else KEY_TILE // 2, PAGE=meta.block_size,
        D1=q1.shape[-1], D1_PAD=_pad(q1.shape[-1]), D2=d2, D2_PAD=_pad(d2), DV=out.shape[-1], DV_PAD=_pad(out.shape[-1]),
        HAS_WINDOW=window is not None, VALUE_IS_K1=value_is_k1,
        PRECISION="ieee" if q1.dtype == torch.float32 else None)
    return grid, args, constexprs, 4 if width <= WIDE_HEAD else 8  # wide heads: registers for 8 warps


def paged_attention(out: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, q2: torch.Tensor | None = None, k2: torch.Tensor | None = None,
                    value_is_k1: bool = False) -> torch.Tensor:
    """out [T, Hq, Dv] = attention of q1 [T, Hq, D1] (and q2 [T, Hq, D2]) over the pages of k1 [N, bs,
    Hkv, D1] (and k2 [N, bs, Hkv, D2]) with values v [N, bs, Hkv, Dv] (or k1's first Dv columns when
    `value_is_k1`). The step's K/V must already be written."""
    q1, q2, k1, k2, v = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q1, q2, k1, k2, v))
    if TRITON_UNAVAILABLE:
        raise RuntimeError(f"attention_backend 'triton' needs Triton: {TRITON_UNAVAILABLE}")
    if q1.device.type == "cpu" and not interpreting():
        raise RuntimeError("attention_backend 'triton' on the CPU runs in Triton's interpreter (for tests): set "
                           "TRITON_INTERPRET=1 in the environment before the process starts")
    grid, args, constexprs, num_warps = _launch_args(out, q1, q2, k1, k2, v, meta, scale, value_is_k1)
    _KERNEL[grid](*args, **constexprs, num_warps=num_warps)
    return out


_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32"}


def compile_for(arch: int, out, q1, k1, v, meta: AttentionMetadata, scale: float, *, q2=None, k2=None,
                value_is_k1: bool = False):
    """The kernel of the launch `paged_attention(out, q1, k1, v, meta, ...)` would make, compiled ahead
    of time for an NVIDIA GPU of compute capability `arch` (90: Hopper) on a machine with none (the
    tensors may be CPU tensors; only their dtypes, strides and the shapes count). Triton must not be
    in interpreter mode. Returns Triton's compiled kernel (its `asm` holds the PTX and cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if TRITON_UNAVAILABLE or interpreting():
        raise RuntimeError(f"compiling needs Triton out of interpreter mode ({TRITON_UNAVAILABLE or 'TRITON_INTERPRET=1'})")
    _, args, constexprs, num_warps = _launch_args(out, q1, q2, k1, k2, v, meta, scale, value_is_k1, tiles=TileMap.build)
    names = list(inspect.signature(_kernel).parameters)
    signature = {name: "*" + _TYPES[arg.dtype] if isinstance(arg, torch.Tensor) else "fp32" if isinstance(arg, float)
                 else "i64" for name, arg in zip(names, args)}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = ASTSource(fn=_KERNEL, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
