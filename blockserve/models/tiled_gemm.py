"""x @ W^T for a weight held only in blocks: tiles of about TILE_VALUES weights dequantised at a
time and multiplied by torch's GEMM, so no float32 copy of W exists beyond one tile. The many-row
(prefill) side of the block layers.

The tile size is measured (docs/cpu.md): the GEMM repacks all of x for every tile, so a tile must
hold enough output rows for that to vanish against its multiplies. 4 MiB of float32 (455 rows of
2048 inputs, or the whole of a 1536 x 576 layer) ran 512 rows of x within the float32 GEMM's time
over the whole weight, where 1 MiB tiles (170 rows at 1536 inputs) took 1.3x it; the tile is
written once and read once, so L3 holds it well enough. A tile's rows are a multiple of
ROW_STEP, so each tile's columns of the output start on a cache line: tiles of 1820 rows (4 MiB at
576 inputs) ran 512 rows of a 3072 x 576 layer 1.1-1.2x slower than tiles of 1808 or 1024.
Dequantising a tile costs ~0.1 ns a weight (csrc: a vector of levels at a time), ~2-5% of the GEMM
at 64 rows."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

TILE_VALUES = 1 << 20  # dequantised weights per tile: 4 MiB of float32
ROW_STEP = 16  # a tile's rows: a multiple of this, so 16 float32 outputs (64 bytes) a step


def tiled_gemm(x: torch.Tensor, rows: int, columns: int, dequantize: Callable[[int, int], torch.Tensor],
               align: int = 1) -> torch.Tensor:
    """x [M, columns] float32 @ W^T, W [rows, columns]; `dequantize(start, count)` gives
    W[start:start + count] as float32, `start` a multiple of `align`."""
    step = math.lcm(align, ROW_STEP)
    tile = max(step, TILE_VALUES // columns // step * step)
    if tile >= rows:
        return x @ dequantize(0, rows).t()
    out = x.new_empty(x.shape[0], rows)
    for start in range(0, rows, tile):
        count = min(tile, rows - start)
        torch.mm(x, dequantize(start, count).t(), out=out[:, start:start + count])
    return out
