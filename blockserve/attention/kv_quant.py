"""The stored form of K/V: plain (float32 / float16 / bfloat16) or quantized (kv/specs.py).

A quantized cache is a tensor of the codes' dtype (int8, or float8_e4m3fn) whose rows are one head
vector of one token each: its D one-byte codes, then the two bytes of its float16 scale
(little-endian), so a block carries its own scales:

    row (D + 2 bytes)   [ c_0 c_1 ... c_{D-1} | scale (float16) ]     x_d ~= c_d * scale
    scale = float16(max_d |x_d| / M), c_d = x_d / scale rounded to the code type (0 where scale is 0)
    int8: M = 127, codes in [-127, 127]        fp8 (e4m3): M = 448, codes in [-448, 448]

One scale per head vector rather than per 32 values (llama.cpp's q8_0): the decode kernel then
folds it into the key's score and the value's weight, one multiply per key instead of one per
32 values. A zeroed row decodes to zeros; a poisoned one (codes -128 for int8, the NaN code 0x7F
for e4m3, and a NaN scale) to NaN. Torch has no index_copy_ / index_fill_ for float8, so writes
and fills go through a uint8 view of the same bytes.

csrc/paged_decode_quantized.cpp writes the same bytes (the same rounding) and reads them in place.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
FLOAT16_MAX = 65504.0
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the quantized code dtypes
POISON_BYTE = {torch.int8: 0x80, torch.float8_e4m3fn: 0x7F}  # int8 -128 (never written); e4m3 NaN


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a cache tensor (or rows read from one) holds quantized rows with their scales."""
    return cache.dtype in CODE_MAX


def encode(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] as rows of a cache of `cache_dtype`: [..., D + 2] int8 rows, or x in that dtype."""
    if cache_dtype not in CODE_MAX:
        return x.to(cache_dtype)
    x, top = x.float(), CODE_MAX[cache_dtype]
    scale = (x.abs().amax(-1, keepdim=True) / top).clamp_(max=FLOAT16_MAX).to(torch.float16)
    wide = scale.float()
    ratio = torch.where(wide > 0, x / wide, 0.0).clamp_(-top, top)
    codes = ratio.round_().to(torch.int8) if cache_dtype == torch.int8 else ratio.to(cache_dtype)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=cache_dtype, device=x.device)
    rows.view(torch.uint8)[..., :-SCALE_BYTES] = codes.view(torch.uint8)
    rows[..., -SCALE_BYTES:].view(torch.float16).copy_(scale)
    return rows


def write(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Store x [T, Hkv, D] at `slots` of a layer's cache viewed as [slots, Hkv, D or D + 2]; returns
    the rows as stored (slots are distinct within a step)."""
    rows = encode(x, flat_cache.dtype)
    if is_quantized(flat_cache):
        flat_cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, rows)
    return rows


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache as values of `dtype` [..., D] (int8 rows dequantised: code * scale)."""
    if not is_quantized(rows):
        return rows.to(dtype)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    scale = rows[..., -SCALE_BYTES:].view(torch.float16).float()
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def fill_rows(cache: torch.Tensor, dim: int, index: torch.Tensor, poison: bool) -> None:
    """Zero (or poison) the rows of `cache` at `index` along `dim`. Quantized rows get codes 0 and
    scale 0 (decoding to 0) or the poison codes and a NaN scale; plain ones 0 or NaN."""
    if not is_quantized(cache):
        cache.index_fill_(dim, index, float("nan") if poison else 0.0)
        return
    cache[..., :-SCALE_BYTES].view(torch.uint8).index_fill_(dim, index, POISON_BYTE[cache.dtype] if poison else 0)
    cache[..., -SCALE_BYTES:].view(torch.float16).index_fill_(dim, index, float("nan") if poison else 0.0)


def head_size(cache: torch.Tensor) -> int:
    """The head size D of a cache [..., D] (plain) or [..., D + 2] (quantized)."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache) else 0)
