"""The stored form of K/V: plain (float32 / float16 / bfloat16) or quantized to int8 (kv/specs.py).

An int8 cache is an int8 tensor whose rows are one head vector of one token each: its D codes,
then the two bytes of its float16 scale (little-endian), so a block carries its own scales:

    row (D + 2 bytes)   [ c_0 c_1 ... c_{D-1} | scale (float16) ]     x_d ~= c_d * scale
    scale = float16(max_d |x_d| / 127), c_d = round(x_d / scale) in [-127, 127] (0 where scale is 0)

One scale per head vector rather than per 32 values (llama.cpp's q8_0): the decode kernel then
folds it into the key's score and the value's weight, one multiply per key instead of one per
32 values. A zeroed row decodes to zeros; a poisoned one (codes -128, scale NaN) to NaN.

csrc/paged_decode_int8.cpp writes the same bytes (the same rounding) and reads them in place.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
FLOAT16_MAX = 65504.0
POISON_CODE = -128  # never written by the quantiser


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a cache tensor (or rows read from one) holds int8 rows with their scales."""
    return cache.dtype == torch.int8


def encode(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] as rows of a cache of `cache_dtype`: [..., D + 2] int8 rows, or x in that dtype."""
    if cache_dtype != torch.int8:
        return x.to(cache_dtype)
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_(max=FLOAT16_MAX).to(torch.float16)
    wide = scale.float()
    codes = torch.where(wide > 0, x / wide, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8, device=x.device)
    rows[..., :-SCALE_BYTES] = codes
    rows[..., -SCALE_BYTES:].view(torch.float16).copy_(scale)
    return rows


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache as values of `dtype` [..., D] (int8 rows dequantised: code * scale)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    scale = rows[..., -SCALE_BYTES:].view(torch.float16).float()
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def fill_rows(cache: torch.Tensor, dim: int, index: torch.Tensor, poison: bool) -> None:
    """Zero (or poison) the rows of `cache` at `index` along `dim`. Quantized rows get codes 0 and
    scale 0 (decoding to 0) or codes -128 and a NaN scale; plain ones 0 or NaN."""
    if not is_quantized(cache):
        cache.index_fill_(dim, index, float("nan") if poison else 0.0)
        return
    cache[..., :-SCALE_BYTES].index_fill_(dim, index, POISON_CODE if poison else 0)
    cache[..., -SCALE_BYTES:].view(torch.float16).index_fill_(dim, index, float("nan") if poison else 0.0)


def head_size(cache: torch.Tensor) -> int:
    """The head size D of a cache [..., D] (plain) or [..., D + 2] (quantized)."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache) else 0)
