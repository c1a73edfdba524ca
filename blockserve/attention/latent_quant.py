"""The stored form of MLA's latent cache rows (attention/mla.py): plain (the model's dtype) or
quantized (int8, or float8 e4m3), one row per token.

A quantized row holds the token's two parts as one-byte codes, each part with its own float16 scale
(kv_quant.quantize: scale = max |x| / M, M = 127 for int8, 448 for e4m3), the scales at its end:

    row (R + Dr + 4 bytes)  [ c codes (R) | k_rope codes (Dr) | scale_c | scale_rope ]
    c_d ~= code_d * scale_c,  k_rope_d ~= code_{R+d} * scale_rope

Two scales, not one: c is RMS-normalised (kv_a_layernorm) while k_rope is the projection as is, so
their magnitudes are unrelated, and one shared scale lets the larger part set the step of the
smaller. Measured on the tiny DeepSeek-V3 model's cached rows (k_rope's RMS 1.6x c's), int8's mean
relative error of c is 0.0053 with its own scale and 0.0076 with a shared one; with k_rope 4x (10x)
larger, 0.030 (0.075), while its own stays 0.0053 (e4m3's floating codes care less: 0.024 against
0.026). The second scale costs 2 bytes a token, 0.35% at DeepSeek-V3's widths (580 bytes instead of
578; tests/attention/test_latent_quant.py). The codes stay contiguous and the scales sit together at
the tail, so one fill covers each (fill_rows) and the triton kernel reads both scales from one
float16 view (`scales`).

A zeroed row decodes to zeros; a poisoned one (int8 codes -128, e4m3's NaN code, NaN scales) to
NaN. Writes and fills go through a uint8 view (torch has no index_copy_ for float8).
"""

from __future__ import annotations

import torch

from blockserve.attention import kv_quant

SCALES_BYTES = 2 * kv_quant.SCALE_BYTES  # one float16 scale per part
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a latent cache (or rows read from one) holds codes and scales."""
    return cache.dtype in QUANTIZED_DTYPES


def encode(latent: torch.Tensor, k_rope: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """latent [..., R], k_rope [..., Dr] as rows of a cache of `cache_dtype`: [..., R + Dr + 4] quantized
    rows, or [..., R + Dr] in that dtype."""
    if cache_dtype not in QUANTIZED_DTYPES:
        return torch.cat([latent, k_rope], dim=-1).to(cache_dtype)
    latent_codes, latent_scale = kv_quant.quantize(latent, cache_dtype)
    rope_codes, rope_scale = kv_quant.quantize(k_rope, cache_dtype)
    codes = torch.cat([latent_codes, rope_codes], dim=-1)
    rows = torch.empty(*codes.shape[:-1], codes.shape[-1] + SCALES_BYTES, dtype=torch.uint8, device=codes.device)
    rows[..., :-SCALES_BYTES] = codes
    rows[..., -SCALES_BYTES:].view(torch.float16).copy_(torch.cat([latent_scale, rope_scale], dim=-1))
    return rows.view(cache_dtype)


def write(flat_cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """Store the step's latent [T, R] and k_rope [T, Dr] at `slots` (distinct) of a layer's cache viewed
    as [slots, row]; returns the rows as stored."""
    rows = encode(latent, k_rope, flat_cache.dtype)
    if is_quantized(flat_cache):
        flat_cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, rows)
    return rows


def decode(rows: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a latent cache as [..., R + Dr] values of `dtype` ([c | k_rope]); quantized rows
    dequantised, each part by its own scale. `rank`: R."""
    if not is_quantized(rows):
        return rows.to(dtype)
    scale = scales(rows).float()
    values = rows[..., :-SCALES_BYTES].float()  # a new tensor: each part scaled in place, no concatenation
    values[..., :rank] *= scale[..., :1]
    values[..., rank:] *= scale[..., 1:]
    return values.to(dtype)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float16 view [..., 2] of quantized rows' scales (c's, then k_rope's): no copy."""
    return rows.view(torch.uint8)[..., -SCALES_BYTES:].view(torch.float16)


def fill_rows(cache: torch.Tensor, dim: int, index: torch.Tensor, poison: bool) -> None:
    """Zero (or poison) the latent rows of `cache` at `index` along `dim`: codes and both scales 0
    (decoding to 0), or the poison codes and NaN scales; plain rows 0 or NaN."""
    kv_quant.fill_rows(cache, dim, index, poison, tail=SCALES_BYTES)

