"""Micro-benchmarks behind docs/performance.md's decode-step figures, peers side by side.

    attention  the native decode kernel (native/csrc/paged_decode.cpp): this CPU's build
               against one with -mno-avx512f (the AVX2 path; the same build on a CPU without
               AVX-512), float32 / float16 / bfloat16
               caches; 64 sequences of 60-245 tokens (SmolLM2's 9 query and 3 KV heads of 64),
               blocks in random order, 30 layers' caches read in turn (from DRAM) or one layer
               30 times (from L3)
    linear     x @ W^T for SmolLM2's gate/up shape [576 -> 3072]: one column-major matrix
               (F.linear) against PanelLinear's 768-column panels, at several row counts

Medians of alternating rounds; one thread unless --threads. Run:

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.decode_kernels
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from blockserve.native.extension import paged_decode_kernel, why_not_native
from blockserve.models.weight_layout import PanelLinear, column_major

LAYERS, SEQS, Q_HEADS, KV_HEADS, HEAD, BLOCK = 30, 64, 9, 3, 64, 16


def timed(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def decode_problem() -> tuple:
    """SEQS decodes of 60-245 tokens over LAYERS float32 caches, blocks in random order: (lens,
    block table, [(k, v)] per layer, q, out, key starts), the same every call (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(60, 246, (SEQS,), generator=gen)
    need = (lens + BLOCK - 1) // BLOCK
    order = torch.randperm(int(need.sum()), generator=gen) + 1
    table = torch.zeros(SEQS, int(need.max()), dtype=torch.int64)
    for i, offset in enumerate(torch.cumsum(need, 0) - need):
        table[i, : need[i]] = order[offset : offset + need[i]]
    shape = (int(need.sum()) + 1, BLOCK, KV_HEADS, HEAD)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(LAYERS)]
    q = torch.randn(SEQS, Q_HEADS, HEAD, generator=gen)
    return lens, table, caches, q, torch.empty_like(q), torch.zeros(SEQS, dtype=torch.int64)


def time_decode_kernels(kernels: dict, rounds: int, problem: tuple) -> dict[str, list[float]]:
    """Seconds per layer of each kernel (None: not built, skipped) over decode_problem()'s caches in
    float32, float16 and bfloat16 (where it reads them), from DRAM (LAYERS caches in turn) and from
    L3 (one cache LAYERS times), every round: {"name, dtype, from where": [per round]}."""
    lens, table, caches, q, out, starts = problem
    results: dict[str, list[float]] = {}
    for _ in range(rounds):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            layers = [(k.to(dtype), v.to(dtype)) for k, v in caches]
            for name, kernel in kernels.items():
                if kernel is None or not kernel.reads(torch.float32, dtype, HEAD):
                    continue
                for where, reads in (("DRAM", layers), ("L3", layers[:1] * LAYERS)):
                    def run(reads=reads, kernel=kernel):
                        for k, v in reads:
                            kernel(out, q, k, v, table, starts, lens, HEAD**-0.5)
                    run()
                    label = f"{name}, {str(dtype).removeprefix('torch.')}, from {where}"
                    results.setdefault(label, []).append(timed(run, 3) / LAYERS)
    return results


def attention(rounds: int) -> None:
    lens, table, caches, q, out, starts = decode_problem()
    kernels = {"native build": paged_decode_kernel(), "-mno-avx512f build": paged_decode_kernel(without_avx512=True)}
    mb = 2 * int(lens.sum()) * KV_HEADS * HEAD * 4 / 1e6
    print(f"decode attention, one layer: {SEQS} sequences, {int(lens.sum())} keys, {mb:.1f} MB of float32 K/V")
    results = time_decode_kernels(kernels, rounds, (lens, table, caches, q, out, starts))
    for label, times in results.items():
        print(f"  {label:<42} {1e3 * statistics.median(times):6.3f} ms per layer")


def linear(rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(3072, 576, generator=gen) for _ in range(LAYERS)]
    whole = [column_major(w) for w in weights]
    panels = [PanelLinear(w, None) for w in weights]
    print("gate/up [576 -> 3072], 30 layers' weights in turn")
    for rows in (1, 16, 64, 128, 512):
        x = torch.randn(rows, 576, generator=gen)
        times: dict[str, list[float]] = {"one column-major matrix": [], "768-column panels": []}
        for _ in range(rounds):
            times["one column-major matrix"].append(timed(lambda: [F.linear(x, w) for w in whole], 2) / LAYERS)
            times["768-column panels"].append(timed(lambda: [p(x) for p in panels], 2) / LAYERS)
        print(f"  {rows:4d} rows: " + ", ".join(f"{k} {1e3 * statistics.median(v):.3f} ms" for k, v in times.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, rounds {args.rounds}")
    if why_not_native() is None:
        attention(args.rounds)
    else:
        print(f"decode attention skipped: native kernels cannot be built here ({why_not_native()})")
    linear(args.rounds)


if __name__ == "__main__":
    main()
