"""MLA decode on the CPU: the exact-length, whole-block and flex flavours, seconds per batched decode
step (triton runs only in Triton's interpreter on the CPU: no speed to measure).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/mla_decode.py
"""

from __future__ import annotations

import statistics
import time

import torch

from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.mla import MLA_BACKENDS

CPU_BACKENDS = {name: cls for name, cls in MLA_BACKENDS.items() if name != "triton"}


def benchmark_decode(num_seqs: int = 32, seq_len: int = 1000, block_size: int = 16, num_heads: int = 16,
                     rank: int = 512, rope: int = 64, nope: int = 128, v: int = 128,
                     repeats: int = 20) -> dict[str, float]:
    """Seconds per batched decode step of each flavour (DeepSeek-V3-shaped heads by default)."""
    gen = torch.Generator().manual_seed(0)
    need = -(-(seq_len + 1) // block_size)
    cache = torch.randn(1 + num_seqs * need, block_size, rank + rope, generator=gen)
    cache[0] = 0
    table = (torch.randperm(num_seqs * need, generator=gen) + 1).view(num_seqs, need)
    layout = BatchLayout.build([1] * num_seqs, [seq_len] * num_seqs)
    meta = AttentionMetadata.build(layout, table, block_size)
    args = (torch.randn(num_seqs, num_heads, nope, generator=gen),
            torch.randn(num_seqs, num_heads, rope, generator=gen),
            torch.randn(num_seqs, rank, generator=gen), torch.randn(num_seqs, rope, generator=gen),
            torch.randn(num_heads, nope, rank, generator=gen) / rank**0.5,
            torch.randn(num_heads, v, rank, generator=gen) / rank**0.5)
    times = {}
    with torch.inference_mode():
        for name, cls in CPU_BACKENDS.items():
            backend = cls((nope + rope) ** -0.5)
            backend.forward(*args, cache, meta)
            t0 = time.perf_counter()
            for _ in range(repeats):
                backend.forward(*args, cache, meta)
            times[name] = (time.perf_counter() - t0) / repeats
    return times


if __name__ == "__main__":
    torch.set_num_threads(1)
    for shape in (dict(num_seqs=8, seq_len=100), dict(), dict(num_seqs=8, seq_len=4000)):
        runs = [benchmark_decode(**shape, repeats=5) for _ in range(7)]
        print(shape, {name: f"{statistics.median(r[name] for r in runs) * 1e3:.2f} ms" for name in CPU_BACKENDS})
