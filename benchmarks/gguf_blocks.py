"""Milliseconds of one gguf_matmul (csrc/gguf_blocks.cpp) per format, row count and build, on a
layer shape of the bundled model's (random blocks with finite scales), one thread, fastest of 15.

    python -m benchmarks.gguf_blocks [--rows 1 8 16]

Prints one line per (build, format, rows) and the other processes' CPU share while it measured.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.cpu_share import CpuShare
from blockserve.models.gguf_block_linear import SCALE_OFFSETS, block_shape
from blockserve.native.extension import quantized_matmul_ops

SHAPES = {"Q5_0": (1536, 576), "Q4_K": (576, 1536), "Q6_K": (576, 1536), "Q8_0": (1536, 576)}


def blocks(format: str, rows: int, columns: int, rng: np.random.Generator) -> torch.Tensor:
    values, nbytes = block_shape(format)
    raw = rng.integers(0, 256, (rows * columns // values, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[format]:
        raw[:, offset:offset + 2] = rng.uniform(-1e-2, 1e-2, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def fastest_ms(fn, repeats: int = 15) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    with CpuShare() as share:
        for build in ("native", "avx2"):
            ops = quantized_matmul_ops(without_avx512=build == "avx2")
            for format, (n, k) in SHAPES.items():
                raw = blocks(format, n, k, rng)
                for m in args.rows:
                    x = torch.randn(m, k)
                    print(f"{build:6} {format:5} {n}x{k} rows {m:3}: "
                          f"{fastest_ms(lambda: ops.gguf_matmul(x, raw, format)):.3f} ms", flush=True)
    print(f"others' CPU share: {share.others:.0%}" if share.others is not None else "others' CPU share: unknown")


if __name__ == "__main__":
    main()
