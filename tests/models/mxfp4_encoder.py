"""An MXFP4 encoder for tests (numpy): float weights [..., N, K] to the Hugging Face checkpoint's
blocks [..., N, K/32, 16] and e8m0 scales [..., N, K/32], each value rounded to the nearest e2m1
value of its block's power-of-two scale (the largest magnitude maps into [4, 8), inside ±6 after
rounding down), two values a byte with the low nibble first."""

from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def encode_mxfp4(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8, scales uint8) of `weights` [..., N, K], K a multiple of 32."""
    *lead, k = weights.shape
    groups = weights.reshape(*lead, k // 32, 32).astype(np.float64)
    peak = np.abs(groups).max(axis=-1)
    exponent = np.where(peak > 0, np.floor(np.log2(np.where(peak > 0, peak, 1.0))) - 2, -127)
    exponent = np.clip(exponent, -127, 127)
    scaled = groups / np.exp2(exponent)[..., None]
    codes = np.abs(scaled[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)  # nearest; ±0 ties go to +0
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, dtype=np.uint8), np.ascontiguousarray(exponent + 127, dtype=np.uint8)


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [..., N, K]: the values blocks and scales stand for."""
    values = np.stack((E2M1[blocks & 0x0F], E2M1[blocks >> 4]), axis=-1).reshape(*blocks.shape[:-1], 32)
    values = values * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*scales.shape[:-1], -1)
