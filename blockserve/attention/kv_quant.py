"""The stored form of K/V: plain (float32 / float16 / bfloat16) or quantized (kv/specs.py).

A quantized cache is a tensor of the codes' storage dtype whose rows are one head vector of one
token each, so a block carries its own scales. Two forms:

One-byte codes (int8, or float8_e4m3fn): its D codes, then its float16 scale (little-endian):

    row (D + 2 bytes)   [ c_0 c_1 ... c_{D-1} | scale (float16) ]     x_d ~= c_d * scale
    scale = float16(max_d |x_d| / M), c_d = x_d / scale rounded to the code type (0 where scale is 0)
    int8: M = 127, codes in [-127, 127]        fp8 (e4m3): M = 448, codes in [-448, 448]

e4m3 keys written with the queries that attend them pick their scale and codes by what those
queries see (`_encode_fp8_keys`): of the scales max |x| / M times 2^(j/8), j = 0..7 (each moves the
vector's values against e4m3's binades, so each rounds them differently), the one whose nearest
rounding has the least J (below), then up to STEER_MOVES codes moved to a neighbouring e4m3 value as
the 4-bit keys' are (docs/cpu.md measures what it buys). The row's layout and every reader are as
for any other e4m3 row.

Rotated 4-bit codes (uint8 storage, kv_cache_dtype "int4"): the vector is first rotated, y = R x,
R = a fixed randomised Hadamard rotation (a seeded sign per channel, then the normalised
Walsh-Hadamard transform over blocks of B channels, B the largest power of two dividing D: all of
D when D is a power of two, 32 for D = 96), which spreads an outlier channel over the block so one
large value no longer sets the step of all the others. Then asymmetric codes over the vector's
range (its minimum and maximum, as llama.cpp's q4_1; measured on outlier-heavy vectors: relative
error 0.05 against 0.075 for symmetric codes, tests/attention/test_kv_quant.py), two a byte, low
nibble first, each code one of 16 levels (INT4_LEVELS) that are denser near the middle, where
rotated coordinates cluster (~12% less squared error than even steps), each value its nearest level:

    row (D/2 + 4 bytes) [ c_1 c_0 | c_3 c_2 | ... | scale (float16) | minimum (float16) ]
    y_d ~= INT4_LEVELS[c_d] * scale + minimum
    minimum = float16(min_d y_d), scale = float16((max_d y_d - minimum) / 15)

Rotated keys written with the queries that attend them (`encode(x, dtype, queries)`: every backend's
write passes the step's rotated queries) then move a few codes to a neighbouring level to take the
rounding error off those queries' directions (`_steer_codes`): the step's own queries predict the
later ones well (queries share a large common direction), and a score's error is the query's dot
product with the key's error. The encoder alone does this: the row's layout and its decoding are
unchanged. On the bundled model, with evenly spaced levels, int4's mean KL is 0.061 unsteered against
0.023 steered (docs/cpu.md); values carry no query to steer by.

Rows decode to the rotated y (`decode`); attention reads them as is: R is orthogonal, so
q . k = (R q) . (R k), and the output over rotated values is R o. A backend rotates its queries
once (`rotate_queries`) when its keys are rotated and un-rotates its output once (`unrotate_output`)
when its values are, never a key.

K and V may be stored apart (kv/specs.py SPLIT_KV_DTYPES, "k8v4"): one-byte keys with rotated 4-bit
values: on the bundled model the keys' 4 bits cost most of int4's KL, and finer 4-bit scale groups
barely help (docs/cpu.md), so int4 keeps one scale and minimum per head vector.

One scale per head vector rather than per 32 values (llama.cpp's q8_0): the decode kernel then
folds it into the key's score and the value's weight, one multiply per key instead of one per
32 values. A zeroed row decodes to zeros; a poisoned one (codes -128 for int8, the NaN code 0x7F
for e4m3, 0xFF for 4-bit; NaN scales and minimum) to NaN. Torch has no index_copy_ / index_fill_
for float8, so writes and fills go through a uint8 view of the same bytes.

csrc/paged_decode_quantized.cpp writes all three forms' bytes in the fused decode step (the same
rounding; the 4-bit form after the same rotation, to the same float32 bits) and reads them in place.
"""

from __future__ import annotations

import functools

import torch

SCALE_BYTES = 2
INT4_SCALE_BYTES = 4  # the rotated 4-bit form: scale and minimum
FLOAT16_MAX = 65504.0
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.uint8: 15.0}  # the quantized code dtypes
POISON_BYTE = {torch.int8: 0x80, torch.float8_e4m3fn: 0x7F, torch.uint8: 0xFF}  # int8 -128 (never written); e4m3 NaN
ROTATION_SEED = 0x5EED  # the rotation's signs: fixed, so every cache (and every restart) shares R
STEER_MOVES = 4  # code moves per 4-bit key row (measured: more barely lower the KL)
STEER_RIDGE = 4.0  # the weight of a key's plain squared error, in units of its queries' mean squared value
FP8_ZERO = 126  # fp8_levels' index of 0: 126 negative and 126 positive finite e4m3 values around it
# An e4m3 key's candidate scales, times max |x| / 448: 2^(j/8) rounded to float32, so that a float32
# scale times one is the same product whether torch computes it in float32 or float64.
FP8_SCALE_STEPS = tuple(torch.tensor([2 ** (j / 8) for j in range(8)], dtype=torch.float32).tolist())
# The 4-bit form's 16 code values, in units of the row's scale above its minimum: 0 and 15 (the row's
# extremes) and 14 levels between, denser near the middle, where rotated coordinates cluster (Lloyd's
# levels for the bundled model's rotated K and V rows mapped onto [0, 15], made symmetric). In 64ths,
# so each level and each midpoint between two is exact in float32.
INT4_LEVELS = tuple(n / 64 for n in (0, 93, 168, 233, 292, 348, 401, 454, 506, 559, 612, 668, 727, 792, 867, 960))


@functools.lru_cache(maxsize=None)
def int4_levels(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """INT4_LEVELS as float32 [16]: code c decodes to levels[c] * scale + minimum."""
    return torch.tensor(INT4_LEVELS, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _int4_bounds(device: torch.device) -> torch.Tensor:
    """The float32 midpoints [15] between adjacent levels: a value's code is how many lie below it."""
    levels = int4_levels(device)
    return (levels[:-1] + levels[1:]) * 0.5


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a cache tensor (or rows read from one) holds quantized rows with their scales."""
    return cache.dtype in CODE_MAX


def is_rotated(cache: torch.Tensor) -> bool:
    """Whether a cache's rows hold rotated vectors (the 4-bit form): attention over it must rotate
    its queries and un-rotate its output."""
    return cache.dtype == torch.uint8


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes after a quantized row's codes: its float16 scale (4-bit: and minimum)."""
    return INT4_SCALE_BYTES if dtype == torch.uint8 else SCALE_BYTES


@functools.lru_cache(maxsize=None)
def rotation(dim: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """R^T [dim, dim] for row vectors (y = x @ R^T): the sign flips, then the normalised Hadamard
    transform of each block of B channels (B the largest power of two dividing dim). Orthogonal."""
    block = dim & -dim
    signs = _row_signs(dim, torch.device("cpu"))
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < block:  # Sylvester's construction: H_2n = [[H, H], [H, -H]]
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    r = torch.block_diag(*[hadamard / block**0.5] * (dim // block)) * signs[None, :]  # R = H diag(s)
    return r.t().contiguous().to(device)


@functools.lru_cache(maxsize=None)
def _row_signs(dim: int, device: torch.device) -> torch.Tensor:
    """R's seeded sign per channel."""
    gen = torch.Generator().manual_seed(ROTATION_SEED)
    return (torch.randint(0, 2, (dim,), generator=gen) * 2.0 - 1.0).to(device)


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x / sqrt(B) over each block of B channels (R's blocks), as butterflies: log2(B) stages of
    elementwise adds, never a matmul, so no thread pool wakes for a decode's few rows (a 64 x 64
    matmul per layer cost 15 ms a call on a contended 2-core machine, beside the decode kernel's
    spinning task pool)."""
    dim = x.shape[-1]
    block = dim & -dim
    y = x.reshape(-1, dim // block, block)
    h = 1
    while h < block:
        pairs = y.view(y.shape[0], dim // block, block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), -2).view(y.shape[0], dim // block, block)
        h *= 2
    return (y * block**-0.5).view(x.shape)


def rotate_queries(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] as R q: what attention over a rotated cache takes as its queries."""
    x = q.float()
    return _hadamard(x * _row_signs(x.shape[-1], x.device)).to(q.dtype)


def unrotate_output(out: torch.Tensor) -> torch.Tensor:
    """Attention's output over a rotated cache, R o, back to o (R^T = diag(s) H / sqrt(B))."""
    x = out.float()
    return (_hadamard(x) * _row_signs(x.shape[-1], x.device)).to(out.dtype)


def _steer_codes(codes: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 queries: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Codes [N, D] (indices into `levels`, ascending float32 code values: y [N, D]'s nearest, each
    standing for scale * levels[c] + minimum, scale and minimum [N, 1]) after up to STEER_MOVES moves
    of one code to a neighbouring level, each the move that lowers
        J = sum_j (q_j . e)^2 + ridge |e|^2,  e = scale * levels[c] + minimum - y,
    most (none once no move lowers it), q_j the row's queries [N, G, D] and ridge = STEER_RIDGE times
    their mean squared value. Float64, moves compared up then down, channel by channel, the first of
    equal ones taken: csrc/paged_decode_quantized.cpp's steer_codes picks the same moves (its sums
    differ from these in float64's last bits, which decides nothing but an exact tie)."""
    n, dim = y.shape
    top = levels.numel() - 1
    levels = levels.double()
    up_step = torch.cat([levels[1:] - levels[:-1], levels.new_zeros(1)])  # code c to c + 1 (none from the top)
    down_step = torch.cat([levels.new_zeros(1), levels[:-1] - levels[1:]])  # code c to c - 1 (none from 0)
    q = queries.double()
    s, c = scale.double(), codes.long()
    err = levels[c] * s + minimum.double() - y.double()
    along = (q * err[:, None]).sum(-1)  # [N, G]: q_j . e
    weight = q.square().sum(1)  # [N, D]
    ridge = _ridge(weight, q.shape[1])
    curvature = weight + ridge
    rows = torch.arange(n, device=y.device)
    for _ in range(STEER_MOVES):
        slope = 2 * ((q * along[..., None]).sum(1) + ridge * err)
        up, down = up_step[c] * s, down_step[c] * s
        gain = torch.cat([torch.where(c < top, up * (curvature * up + slope), torch.inf),
                          torch.where(c > 0, down * (curvature * down + slope), torch.inf)], -1)
        best, at = gain.min(-1)
        move = (best < 0) & torch.isfinite(best)
        if not move.any():
            break
        channel = at % dim
        upward = at < dim
        delta = torch.where(upward, up[rows, channel], down[rows, channel]) * move
        c[rows, channel] += torch.where(upward, 1, -1) * move
        err[rows, channel] += delta
        along += q[rows, :, channel] * delta[:, None]
    return c.to(codes.dtype)


def _ridge(weight: torch.Tensor, group: int) -> torch.Tensor:
    """STEER_RIDGE times the queries' mean squared value [N, 1], from `weight` [N, D]: each channel's
    sum of squares over the row's `group` queries."""
    return STEER_RIDGE * weight.sum(-1, keepdim=True) / (group * weight.shape[-1])


@functools.lru_cache(maxsize=None)
def fp8_levels(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The 253 finite e4m3 values in ascending order, float32 [253]: index FP8_ZERO is 0, byte b of a
    positive value sits at FP8_ZERO + b, of a negative one (0x80 | b) at FP8_ZERO - b."""
    magnitudes = torch.arange(FP8_ZERO + 1, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    return torch.cat([-magnitudes.flip(0)[:-1], magnitudes]).to(device)


def _fp8_index(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 code bytes (uint8, never NaN) as indices into fp8_levels (-0 as 0)."""
    magnitude = (codes & 0x7F).long()
    return torch.where(codes >= 0x80, FP8_ZERO - magnitude, FP8_ZERO + magnitude)


def _fp8_bytes(index: torch.Tensor) -> torch.Tensor:
    """Indices into fp8_levels as e4m3 code bytes (0 as +0)."""
    return torch.where(index >= FP8_ZERO, index - FP8_ZERO, 0x80 | (FP8_ZERO - index)).to(torch.uint8)


def _encode_fp8_keys(x: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Keys x [..., Hkv, D] as e4m3 rows whose error is steered off their `queries` [..., Hq, D] (the
    module docstring): per row, of the scales float16(min(max |x| / 448 * FP8_SCALE_STEPS[j], 65504)),
    the one whose nearest rounding has the least J (float64; the first of equal ones), then its codes
    steered (`_steer_codes` over fp8_levels)."""
    dim = x.shape[-1]
    y = x.float().reshape(-1, dim)
    q = queries.double().reshape(y.shape[0], -1, dim)
    ridge = _ridge(q.square().sum(1), q.shape[1])
    base = y.abs().amax(-1, keepdim=True) / CODE_MAX[torch.float8_e4m3fn]
    best = codes = scale = None
    for step in FP8_SCALE_STEPS:
        candidate = (base * step).clamp_(max=FLOAT16_MAX).to(torch.float16)
        round_codes = _round_codes(y, candidate.float(), torch.float8_e4m3fn)
        err = round_codes.double() * candidate.double() - y.double()
        objective = (q * err[:, None]).sum(-1).square().sum(-1, keepdim=True) \
            + ridge * err.square().sum(-1, keepdim=True)
        if best is None:
            best, codes, scale = objective, round_codes.view(torch.uint8), candidate
            continue
        better = objective < best
        best = torch.where(better, objective, best)
        codes = torch.where(better, round_codes.view(torch.uint8), codes)
        scale = torch.where(better, candidate, scale)
    wide = scale.float()
    index = _steer_codes(_fp8_index(codes), y, wide, torch.zeros_like(wide), q, fp8_levels(x.device))
    rows = torch.empty(*x.shape[:-1], dim + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    flat = rows.view(-1, dim + SCALE_BYTES)
    flat[:, :dim] = _fp8_bytes(index)
    flat[:, dim:].view(torch.float16).copy_(scale)
    return rows.view(torch.float8_e4m3fn)


def _encode_int4(x: torch.Tensor, queries: torch.Tensor | None) -> torch.Tensor:
    y = rotate_queries(x.float())
    low, high = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    minimum = low.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)
    scale = ((high - minimum.float()) / 15).clamp_(max=FLOAT16_MAX).to(torch.float16)
    wide = scale.float()
    ratio = torch.where(wide > 0, (y - minimum.float()) / wide, 0.0)
    codes = (ratio[..., None] > _int4_bounds(x.device)).sum(-1).float()
    if queries is not None:
        heads, dim = x.shape[-2], x.shape[-1]
        group = queries.shape[-2] // heads
        steered = _steer_codes(codes.reshape(-1, dim), y.reshape(-1, dim), wide.reshape(-1, 1),
                               minimum.float().reshape(-1, 1), queries.float().reshape(-1, group, dim),
                               int4_levels(x.device))
        codes = torch.where(wide > 0, steered.view(codes.shape), codes)
    codes = codes.to(torch.uint8)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] // 2 + INT4_SCALE_BYTES, dtype=torch.uint8, device=x.device)
    rows[..., :-INT4_SCALE_BYTES] = codes[..., 0::2] | (codes[..., 1::2] << 4)
    rows[..., -INT4_SCALE_BYTES:].view(torch.float16).copy_(torch.cat([scale, minimum], -1))
    return rows


def encode(x: torch.Tensor, cache_dtype: torch.dtype, queries: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] as rows of a cache of `cache_dtype`: [..., D + 2] one-byte rows, [..., D/2 + 4]
    rotated 4-bit rows, or x in that dtype. `queries` [..., Hq, D], for keys x [..., Hkv, D]: the
    queries of the same tokens as the cache's attention takes them (rotated, `rotate_queries`, for
    4-bit keys), query head h reading key head h // (Hq / Hkv); 4-bit and e4m3 rows then steer their
    rounding error off them (the module docstring), int8 rows do not use them."""
    if cache_dtype not in CODE_MAX:
        return x.to(cache_dtype)
    if queries is not None and (queries.shape[:-2] != x.shape[:-2] or queries.shape[-1] != x.shape[-1]
                                or queries.shape[-2] % x.shape[-2]):
        raise ValueError(f"queries {tuple(queries.shape)} do not match keys {tuple(x.shape)}: [..., Hq, D] "
                         f"over [..., Hkv, D] with Hq a multiple of Hkv expected")
    if cache_dtype == torch.uint8:
        return _encode_int4(x, queries)
    if cache_dtype == torch.float8_e4m3fn and queries is not None:
        return _encode_fp8_keys(x, queries)
    codes, scale = quantize(x, cache_dtype)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=cache_dtype, device=x.device)
    rows.view(torch.uint8)[..., :-SCALE_BYTES] = codes
    rows[..., -SCALE_BYTES:].view(torch.float16).copy_(scale)
    return rows


def quantize(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as one-byte codes of `cache_dtype` (int8 or e4m3), as their bytes [..., D] uint8, and
    its float16 scale [..., 1]: x_d ~= code_d * scale (the module docstring's one-byte form)."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / CODE_MAX[cache_dtype]).clamp_(max=FLOAT16_MAX).to(torch.float16)
    return _round_codes(x, scale.float(), cache_dtype).view(torch.uint8), scale


def _round_codes(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x / scale (float32; 0 where the scale is 0) clamped to the code range and rounded to the code
    dtype (int8: half to even; e4m3: torch's conversion), as codes of `cache_dtype`."""
    top = CODE_MAX[cache_dtype]
    ratio = torch.where(scale > 0, x / scale, 0.0).clamp_(-top, top)
    return ratio.round_().to(torch.int8) if cache_dtype == torch.int8 else ratio.to(cache_dtype)


def write(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
          queries: torch.Tensor | None = None) -> torch.Tensor:
    """Store x [T, Hkv, D] at `slots` of a layer's cache viewed as [slots, Hkv, row]; returns
    the rows as stored (slots are distinct within a step). Keys pass the step's rotated queries
    [T, Hq, D] (`encode`)."""
    rows = encode(x, flat_cache.dtype, queries)
    if is_quantized(flat_cache):
        flat_cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, rows)
    return rows


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache as values of `dtype` [..., D]: one-byte rows dequantised (code * scale),
    4-bit rows to the rotated vectors (INT4_LEVELS[code] * scale + minimum; the module docstring)."""
    if not is_quantized(rows):
        return rows.to(dtype)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if rows.dtype == torch.uint8:
        scale, minimum = rows[..., -INT4_SCALE_BYTES:].view(torch.float16).float().split(1, -1)
        packed = rows[..., :-INT4_SCALE_BYTES]
        codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).long()
        return (int4_levels(rows.device)[codes] * scale + minimum).to(dtype)
    scale = rows[..., -SCALE_BYTES:].view(torch.float16).float()
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def fill_rows(cache: torch.Tensor, dim: int, index: torch.Tensor, poison: bool, tail: int | None = None) -> None:
    """Zero (or poison) the rows of `cache` at `index` along `dim`. Quantized rows get codes 0 and
    scales 0 (decoding to 0) or the poison codes and NaN scales; plain ones 0 or NaN. `tail`: the
    bytes of float16 scales closing each row (None: a head vector's, `scale_bytes`)."""
    if not is_quantized(cache):
        cache.index_fill_(dim, index, float("nan") if poison else 0.0)
        return
    tail = scale_bytes(cache.dtype) if tail is None else tail
    cache[..., :-tail].view(torch.uint8).index_fill_(dim, index, POISON_BYTE[cache.dtype] if poison else 0)
    cache[..., -tail:].view(torch.float16).index_fill_(dim, index, float("nan") if poison else 0.0)


def head_size(cache: torch.Tensor) -> int:
    """The head size D of a cache [..., D] (plain), [..., D + 2] (one-byte codes) or [..., D/2 + 4]."""
    if cache.dtype == torch.uint8:
        return 2 * (cache.shape[-1] - INT4_SCALE_BYTES)
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache) else 0)
