"""The launcher of the `triton` attention backend's kernel (triton_kernel.py): every row of a step
(decodes and prefill chunks, flattened) attends to its sequence's pages in place in one launch,
reading only the slots it may see.

    tiles       each sequence's query rows in tiles of BLOCK_Q (one in a decode-only step); the
                grid is (tiles, KV heads, blocks of G_BLOCK query heads sharing a KV head)
    tile map    which sequence and first row each tile is, computed with tensor ops from the
                metadata's tensors; the grid's size from shapes alone (spare tiles do nothing)
    key splits  in a decode-only step whose programs would leave multiprocessors idle (a small
                batch), each row's keys are split over up to MAX_SPLITS programs, then combined

Shapes and where it runs: tl.dot needs every dimension >= 16, so head widths are padded to a
power of two >= 16 (masked) and tiles to >= 16 rows; a key step spans whole pages or part of one,
so any block size works. On CUDA the kernel is compiled by Triton for the device; on the CPU it runs
in Triton's interpreter (TRITON_INTERPRET=1: slow, for tests). `compile_for` builds it for a GPU
target without one (ptxas ships with Triton), which is how CI checks that the CUDA build compiles.

Quantized caches (attention/kv_quant.py: int8, e4m3, rotated 4-bit; keys and values each in their
own form) are read in place: `_codes` passes the cache as its code pointer and a float16 view of its
rows' tails as the scale pointer, and the kernel dequantises in registers. MLA's quantized latent rows
(attention/latent_quant.py) likewise: both parts' codes in place, their two scales from one view.

No host sync and no host list, so a decode step can be captured as a CUDA graph. Triton is
imported on the first launch: importing blockserve does not pay for it.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from dataclasses import dataclass

import torch

from blockserve.attention import kv_quant
from blockserve.attention.metadata import AttentionMetadata

# The backend is unavailable without Triton, the rest of blockserve is not.
TRITON_UNAVAILABLE = (None if importlib.util.find_spec("triton") is not None
                      else "the triton package is not installed; pip install triton")

MIN_DOT = 16  # tl.dot's smallest dimension
PREFILL_TILE = 16  # query rows per tile at most when a step has a prefill chunk (decode-only steps: one)
MAX_TILE_ELEMENTS = 16384  # tile rows x head width at most (MLA's 16 heads x 576: one query row per tile)
MAX_HEAD_BLOCK = 16  # query heads per program at most (MLA's 128 heads: 8 programs per row)
KEY_TILE = 64  # keys per step of the online softmax (half that for heads wider than WIDE_HEAD)
WIDE_HEAD = 256
MAX_SPLITS = 16  # key splits per decode row at most (triton_kernel.py's flash-decoding)
MIN_SPLIT_KEYS = 256  # keys per split at least, counted over the block table's width
FP8_CAPABILITY = (8, 9)  # Triton converts e4m3 (fp8e4nv) on these GPUs and newer


def _kernels():
    """triton_kernel.py, imported on first use (with Triton)."""
    if TRITON_UNAVAILABLE:
        raise RuntimeError(f"attention_backend 'triton' needs Triton: {TRITON_UNAVAILABLE}")
    from blockserve.attention import triton_kernel

    return triton_kernel


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter in this process (TRITON_INTERPRET=1 when it
    was first imported); False without Triton."""
    return TRITON_UNAVAILABLE is None and _kernels().interpreting()


def unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` (None: it can)."""
    if TRITON_UNAVAILABLE:
        return TRITON_UNAVAILABLE
    if device.type == "cpu" and not interpreting():
        return ("on the CPU it runs only in Triton's interpreter (for tests): set TRITON_INTERPRET=1 in the "
                "environment before the process starts")
    return None


def fp8_unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot read fp8 (e4m3) codes on `device` (None: it can): CUDA GPUs older than
    FP8_CAPABILITY cannot convert them."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= FP8_CAPABILITY:
        return None
    return (f"the triton kernel reads fp8 (e4m3) codes on GPUs of compute capability {FP8_CAPABILITY[0]}."
            f"{FP8_CAPABILITY[1]} or newer; {device} is {major}.{minor}: use kv_cache_dtype int8")


def _pad(n: int) -> int:
    """n rounded up to a power of two, at least MIN_DOT (a tl.arange's and a tl.dot's width)."""
    return max(MIN_DOT, 1 << max(0, n - 1).bit_length())


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
    """Query rows per tile, a power of two (a tile is a tl.arange): one in a decode-only step (a shape
    fact, so the same in a captured graph), else up to PREFILL_TILE within MAX_TILE_ELEMENTS."""
    if meta.slot_mapping.shape[0] == meta.block_table.shape[0]:
        return 1
    rows = max(1, min(PREFILL_TILE, MAX_TILE_ELEMENTS // (heads_per_program * width)))
    return 1 << (rows.bit_length() - 1)


def tile_map(meta: AttentionMetadata, rows: int) -> TileMap:
    """The step's tile map, built by the group's first layer and reused by the others."""
    key = ("triton", "tiles", rows)
    if key not in meta.derived:
        meta.derived[key] = TileMap.build(meta, rows)
    return meta.derived[key]


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere: no key splits on the CPU by default)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def key_splits(meta: AttentionMetadata, rows: int, programs: int, device: torch.device) -> int:
    """Key splits per decode row (a power of two): enough for about two programs per multiprocessor,
    none for prefill tiles, and at most one per MIN_SPLIT_KEYS of the longest context a table can
    hold (max_model_len's, not the step's width). Shapes only, so a captured graph splits as it was
    captured, and an eager step as the graph would."""
    if rows != 1:
        return 1
    by_context = -(-meta.max_table_width * meta.block_size // MIN_SPLIT_KEYS)
    splits = max(1, min(MAX_SPLITS, 2 * _multiprocessors(device) // programs, by_context))
    return 1 << (splits.bit_length() - 1)


def _codes(cache: torch.Tensor, width: int, side: str) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(the kernel's code form: 0 plain, 1 int8, 2 rotated 4-bit, 3 e4m3; the code pointer's tensor;
    the float16 view [N, bs, H, 1 or 2] of each row's scale (and minimum), None when plain) of a cache
    [N, bs, H, row] whose rows hold head vectors of `width` values. e4m3 codes go as bytes (the
    kernel bitcasts them: Triton's interpreter cannot fill a masked float8 load)."""
    if not kv_quant.is_quantized(cache):
        return 0, cache, None
    if kv_quant.head_size(cache) != width:
        raise ValueError(f"the {side} cache's rows hold {kv_quant.head_size(cache)} values, the kernel reads {width}")
    if kv_quant.is_rotated(cache) and width % 4:
        raise ValueError(f"the triton kernel reads 4-bit rows of a head size divisible by 4, got {width}")
    if cache.dtype == torch.float8_e4m3fn and (why := fp8_unavailable(cache.device)):  # the engine refuses at start-up
        raise ValueError(why)
    codes = width // 2 if kv_quant.is_rotated(cache) else width
    form = {torch.int8: 1, torch.uint8: 2, torch.float8_e4m3fn: 3}[cache.dtype]
    scales = cache.view(torch.uint8)[..., codes:].view(torch.float16)
    return form, cache.view(torch.uint8) if form == 3 else cache, scales


def _latent_codes(k1: torch.Tensor, k2: torch.Tensor, key_scales: torch.Tensor, value_is_k1: bool):
    """(the kernel's code form, k1's and k2's code tensors) of a quantized MLA latent cache: int8 or
    e4m3 codes in both parts (e4m3 as bytes), each part's scale in `key_scales` [N, bs, H, 2]."""
    if k2 is None or not value_is_k1:
        raise ValueError("key_scales are those of MLA's quantized latent rows: give k2 and value_is_k1 with them")
    if k1.dtype != k2.dtype or k1.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"a quantized latent cache holds int8 or e4m3 codes in both parts, got {k1.dtype} and "
                         f"{k2.dtype}")
    if key_scales.dtype != torch.float16 or key_scales.shape[-1] != 2:
        raise ValueError(f"key_scales must be each row's two float16 scales [..., 2], got {key_scales.dtype} "
                         f"{tuple(key_scales.shape)}")
    if k1.dtype == torch.float8_e4m3fn:
        if why := fp8_unavailable(k1.device):  # the engine refuses at start-up
            raise ValueError(why)
        return 3, k1.view(torch.uint8), k2.view(torch.uint8)
    return 1, k1, k2


def _launch_args(out, q1, q2, k1, k2, v, meta: AttentionMetadata, scale: float, value_is_k1: bool,
                 splits: int | None, tiles=tile_map, sinks: torch.Tensor | None = None,
                 key_scales: torch.Tensor | None = None):
    """(grid, positional args, constexpr kwargs, num_warps) of one launch; with key splits the args
    name the partial results' buffers, which `paged_attention` combines. Caches are [pages, bs,
    heads, dim]. `splits`: None for key_splits' choice."""
    num_kv_heads = k1.shape[2]
    group = q1.shape[1] // num_kv_heads
    head_block = min(1 << (group - 1).bit_length(), MAX_HEAD_BLOCK)
    if (key_scales is None and any(t is not None and kv_quant.is_quantized(t) for t in (k1, k2, v))
            and (q2 is not None or value_is_k1)):
        raise ValueError("the triton kernel reads quantized caches as one-part keys with their own values, or as "
                         "MLA's latent rows with their key_scales")
    if value_is_k1 and out.shape[-1] != k1.shape[-1]:
        raise ValueError(f"values read from k1 need out's width {out.shape[-1]} to be k1's {k1.shape[-1]}")
    d2 = 0 if q2 is None else q2.shape[-1]
    width = max(_pad(q1.shape[-1]) + (_pad(d2) if d2 else 0), _pad(out.shape[-1]))
    tiles = tiles(meta, tile_rows(meta, head_block, width))
    head_blocks = -(-group // head_block)
    if splits is None:
        splits = key_splits(meta, tiles.rows, tiles.seq.shape[0] * num_kv_heads * head_blocks, q1.device)
    elif splits > 1 and (tiles.rows != 1 or splits & (splits - 1)):
        raise ValueError(f"key splits apply to decode-only steps, as a power of two; got {splits}")
    grid = (tiles.seq.shape[0], num_kv_heads, head_blocks * splits)
    parts = out, out  # unused without splits
    if splits > 1:
        rows = (out.shape[0], out.shape[1], splits)
        parts = (out.new_empty(*rows, _pad(out.shape[-1]), dtype=torch.float32),
                 out.new_empty(rows, dtype=torch.float32))
    k2_codes = 0
    if key_scales is not None:  # MLA's quantized latent: both parts coded, values share k1's codes and scale
        k_codes, k1, k2 = _latent_codes(k1, k2, key_scales, value_is_k1)
        k2_codes, v_codes, k_scales, v_scales = k_codes, k_codes, key_scales, key_scales
    else:
        k_codes, k1, k_scales = _codes(k1, q1.shape[-1], "key")
        v_codes, v, v_scales = (0, v, None) if value_is_k1 else _codes(v, out.shape[-1], "value")
    q2 = q1 if q2 is None else q2
    k2 = k1 if k2 is None else k2
    k_scales = q1 if k_scales is None else k_scales  # unused when plain
    v_scales = q1 if v_scales is None else v_scales
    window = meta.sliding_window
    args = (out, *parts, q1, q2, k1, k2, v, q1 if sinks is None else sinks, k_scales, v_scales,
            meta.block_table, meta.seq_len, meta.key_start, tiles.query_start,
            tiles.seq, tiles.first_row, scale * math.log2(math.e), window or 0,
            out.stride(0), out.stride(1), q1.stride(0), q1.stride(1), q2.stride(0), q2.stride(1),
            *k1.stride()[:3], *k2.stride()[:3], *v.stride()[:3], *k_scales.stride()[:3], *v_scales.stride()[:3],
            meta.block_table.stride(0))
    constexprs = dict(
        G=group, G_BLOCK=head_block, BLOCK_Q=tiles.rows, BLOCK_M=max(MIN_DOT, tiles.rows * head_block),
        BLOCK_N=KEY_TILE if width <= WIDE_HEAD else KEY_TILE // 2, PAGE=meta.block_size,
        D1=q1.shape[-1], D1_PAD=_pad(q1.shape[-1]), D2=d2, D2_PAD=_pad(d2),
        DV=out.shape[-1], DV_PAD=_pad(out.shape[-1]),
        HAS_WINDOW=window is not None, VALUE_IS_K1=value_is_k1,
        PRECISION="ieee" if q1.dtype == torch.float32 else None, SPLITS=splits, HAS_SINKS=sinks is not None,
        K_CODES=k_codes, V_CODES=v_codes, K2_CODES=k2_codes)
    return grid, args, constexprs, 4 if width <= WIDE_HEAD else 8  # wide heads: registers for 8 warps


def paged_attention(out: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, q2: torch.Tensor | None = None, k2: torch.Tensor | None = None,
                    value_is_k1: bool = False, splits: int | None = None,
                    sinks: torch.Tensor | None = None, key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, Hq, Dv] = attention of q1 [T, Hq, D1] (and q2 [T, Hq, D2]) over the pages of k1 [N, bs,
    Hkv, D1] (and k2 [N, bs, Hkv, D2]) with values v [N, bs, Hkv, Dv] (or k1's first Dv columns when
    `value_is_k1`), each head's logit `sinks` [Hq] in the softmax's denominator when given. k1 and v may
    be quantized caches (kv_quant.py rows, each in its own form; not with q2 or `value_is_k1`): a
    4-bit one holds rotated vectors, so its queries must come rotated (keys) and its output is rotated
    (values). MLA's quantized latent rows (latent_quant.py) come as their int8 or e4m3 code views k1 and
    k2 (value_is_k1) with `key_scales` [N, bs, Hkv, 2], each row's two parts' float16 scales. The
    step's K/V must already be written. `splits`: key splits per decode row (None: key_splits' choice)."""
    q1, q2, k1, k2, v = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q1, q2, k1, k2, v))
    if (why := unavailable(q1.device)) is not None:
        raise RuntimeError(f"attention_backend 'triton' cannot run on {q1.device}: {why}")
    kernels = _kernels()
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    grid, args, constexprs, num_warps = _launch_args(out, q1, q2, k1, k2, v, meta, scale, value_is_k1, splits,
                                                     sinks=sinks, key_scales=key_scales)
    kernels.KERNEL[grid](*args, **constexprs, num_warps=num_warps)
    if constexprs["SPLITS"] > 1:
        kernels.COMBINE[out.shape[:2]](*_combine_args(args, constexprs))
    return out


def _combine_args(args, constexprs) -> tuple:
    """The combine kernel's arguments, from the attention launch's."""
    out, part_out, part_lse = args[:3]
    sinks = args[8]
    return (out, part_out, part_lse, sinks, out.stride(0), out.stride(1), constexprs["SPLITS"], constexprs["DV"],
            constexprs["DV_PAD"], constexprs["HAS_SINKS"])


_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32",
          torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}


def compile_for(arch: int, out, q1, k1, v, meta: AttentionMetadata, scale: float, *, q2=None, k2=None,
                value_is_k1: bool = False, splits: int = 1, key_scales=None) -> list:
    """The kernels the launch `paged_attention(out, q1, k1, v, meta, ..., splits=splits)` would run
    (the attention kernel, and with key splits the combine kernel), compiled ahead of time for an
    NVIDIA GPU of compute capability `arch` (90: Hopper) on a machine with none (the tensors may be
    CPU tensors; only their dtypes, strides, alignment and shapes count). Triton must not be in
    interpreter mode. Returns Triton's compiled kernels (each one's `asm` holds the PTX and cubin)."""
    kernels = _kernels()
    if kernels.interpreting():
        raise RuntimeError("compiling needs Triton out of interpreter mode (TRITON_INTERPRET=1 is set)")
    _, args, constexprs, num_warps = _launch_args(out, q1, q2, k1, k2, v, meta, scale, value_is_k1, splits,
                                                  tiles=TileMap.build, key_scales=key_scales)
    compiled = [_compile(kernels.KERNEL, args, constexprs, num_warps, arch)]
    if splits > 1:
        compiled.append(_compile(kernels.COMBINE, _combine_args(args, constexprs), {}, 4, arch))
    return compiled


def _compile(kernel, args, constexprs: dict, num_warps: int, arch: int):
    """`kernel` compiled for `args` (the constexprs among them by name in `constexprs` or in place),
    specialized as Triton's launcher specializes a launch: integers equal to 1 become constants,
    integers that are multiples of 16 and 16-byte-aligned pointers are marked divisible by 16 (what
    lets loads be vectorized)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs, signature, attrs = dict(constexprs), {}, {}
    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            continue
        arg = args[i]
        if i in kernel.constexprs:
            constexprs[name] = arg
        elif isinstance(arg, float):
            signature[name] = "fp32"
        elif isinstance(arg, torch.Tensor):
            signature[name] = "*" + _TYPES[arg.dtype]
            if arg.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg == 1:
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -2**31 <= arg < 2**31 else "i64"
            if arg % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
