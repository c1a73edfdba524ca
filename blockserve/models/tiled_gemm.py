"""x @ W^T for a weight held only in blocks: tiles of about TILE_VALUES weights dequantised at a
time (1 MiB of float32, cache-resident) and multiplied by torch's GEMM, so no float32 copy of W
exists beyond one tile. The many-row (prefill) side of the block layers."""

from __future__ import annotations

from collections.abc import Callable

import torch

TILE_VALUES = 1 << 18  # dequantised weights per tile: 1 MiB of float32


def tiled_gemm(x: torch.Tensor, rows: int, columns: int, dequantize: Callable[[int, int], torch.Tensor],
               align: int = 1) -> torch.Tensor:
    """x [M, columns] float32 @ W^T, W [rows, columns]; `dequantize(start, count)` gives
    W[start:start + count] as float32, `start` a multiple of `align`."""
    tile = max(align, TILE_VALUES // columns // align * align)
    if tile >= rows:
        return x @ dequantize(0, rows).t()
    out = x.new_empty(x.shape[0], rows)
    for start in range(0, rows, tile):
        count = min(tile, rows - start)
        torch.mm(x, dequantize(start, count).t(), out=out[:, start:start + count])
    return out
