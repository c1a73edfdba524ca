"""x @ W^T over GGUF blocks (native/csrc/quantized_matmul.cpp) against the float32 matmul it
replaces, for SmolLM2-135M's shapes and formats (Q4_1 layers, the Q8_0 tied lm_head):

    int16    quantized_matmul_int16: x rounded to int16 per block of 32, integer dot products
    int8     quantized_matmul_int8: x rounded to int8 per block of 32, integer dot products
    float    quantized_matmul: weights dequantised in registers, float32 activations
    tiled    QuantizedLinear's many-row path: tiles dequantised from the packed blocks
             (quantized_dequantize) multiplied by torch's GEMM, no float32 copy kept
    dense    a resident float32 copy (column-major nn.Linear, or PanelLinear for >= PANEL_MIN_OUT
             outputs): what the many-row path ran on before the tiles

Each cell: the median over --rounds of the mean of a few calls, the variants interleaved in
every round; at one thread a call is timed by this thread's CPU time (time.thread_time), so the
time the process waits while others hold the CPU (a shared machine) is not counted, at more
threads by the wall clock (the machine may be shared; the fastest round is kept too, and the printed speed-ups
in brackets compare those); weight GB/s counts the packed bytes the kernels read
(the float32 bytes for dense). Prints a table per thread count and writes the raw figures, the
CPU flags and the thread settings as JSON. Run:

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.quantized_matmul [--avx2] [--threads 1 2] [--rows 64 128 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gguf
import numpy as np
import torch

from blockserve.native.extension import quantized_matmul_ops, why_not_native
from blockserve.bench.common import environment, print_environment, write_json
from blockserve.models.quantized_linear import PACKED_BYTES, QuantizedLinear, pack_blocks
from blockserve.models.weight_layout import PANEL_MIN_OUT, PanelLinear, column_major

# name: (in_features, out_features, GGUF format) as in SmolLM2-135M-Instruct.Q4_1.gguf
SHAPES = {"qkv": (576, 960, "Q4_1"), "o": (576, 576, "Q4_1"), "gate_up": (576, 3072, "Q4_1"),
          "down": (1536, 576, "Q4_1"), "lm_head": (576, 49152, "Q8_0")}
ROWS = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = ("int16", "int8", "float", "tiled", "dense")
INTEGER = ("int16", "int8")


def layer(in_features: int, out_features: int, format: str):
    """Packed blocks of a random matrix and the float32 layer over gguf's dequantisation of them."""
    weights = np.random.default_rng(0).standard_normal((out_features, in_features)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[format]
    raw = gguf.quants.quantize(weights, kind)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, kind).copy())
    if out_features >= PANEL_MIN_OUT:
        dense = PanelLinear(weight, None)
    else:
        dense = torch.nn.Linear(in_features, out_features, bias=False)
        dense.weight.data = column_major(weight)
    return pack_blocks(raw, format), dense


def mean_seconds(fn, calls: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def measure(ops, shapes: dict, rows: tuple[int, ...], threads: int, rounds: int, target_s: float) -> list[dict]:
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    cells = []
    with torch.inference_mode():
        for name, (k, n, format) in shapes.items():
            packed, dense = layer(k, n, format)
            tiled = QuantizedLinear(packed, format, n, k)
            q4 = format != "Q8_0"
            packed_bytes = -(-n // 4) * k // 32 * PACKED_BYTES[format]
            for m in rows:
                x = torch.randn(m, k)
                fns = {"int16": lambda: ops.quantized_matmul_int16(x, packed, n, q4),
                       "int8": lambda: ops.quantized_matmul_int8(x, packed, n, q4),
                       "float": lambda: ops.quantized_matmul(x, packed, n, q4),
                       "tiled": lambda: tiled.gemm(x),
                       "dense": lambda: dense(x)}
                calls = {v: max(1, int(target_s / max(mean_seconds(fn, 2, clock), 1e-7))) for v, fn in fns.items()}
                times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for _ in range(rounds):
                    for v in VARIANTS:
                        times[v].append(mean_seconds(fns[v], calls[v], clock))
                us = {v: statistics.median(times[v]) * 1e6 for v in VARIANTS}
                best = {v: min(times[v]) * 1e6 for v in VARIANTS}
                cells.append({"shape": name, "in": k, "out": n, "format": format, "rows": m, "threads": threads,
                              "clock": clock.__name__,
                              "us": us, "min_us": best,
                              "samples_us": {v: [t * 1e6 for t in times[v]] for v in VARIANTS},
                              "weight_gb_s": {**{v: packed_bytes / us[v] / 1e3 for v in VARIANTS[:-1]},
                                              "dense": 4 * n * k / us["dense"] / 1e3}})
    return cells


def print_table(cells: list[dict]) -> None:
    ratios = [f"{v}/{peer}" for v in INTEGER for peer in ("float", "dense")] + ["tiled/dense"]
    print(f"{'shape':<8} {'rows':>4} " + " ".join(f"{v + ' us':>9}" for v in VARIANTS) + " "
          + " ".join(f"{r:>11}" for r in ratios) + "   (medians; speed-ups: peer's time / the variant's)")
    for c in cells:
        us = c["us"]
        print(f"{c['shape']:<8} {c['rows']:>4} " + " ".join(f"{us[v]:>9.1f}" for v in VARIANTS) + " "
              + " ".join(f"{us[peer] / us[v]:>10.2f}x" for v in INTEGER for peer in ("float", "dense"))
              + f" {us['dense'] / us['tiled']:>10.2f}x")


def crossovers(cells: list[dict], variant: str) -> dict:
    """Per shape and thread count: the most rows up to which `variant` beats dense at every row count measured."""
    best: dict[str, int] = {}
    for key in dict.fromkeys(f"{c['shape']}@{c['threads']}" for c in cells):
        best[key] = 0
        for c in sorted((c for c in cells if f"{c['shape']}@{c['threads']}" == key), key=lambda c: c["rows"]):
            if c["us"][variant] >= c["us"]["dense"]:
                break
            best[key] = c["rows"]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--target-ms", type=float, default=2.0, help="time per variant per round")
    parser.add_argument("--avx2", action="store_true", help="the kernel built with -mno-avx512f (the AVX2 path)")
    parser.add_argument("--json", default="results/quantized_matmul.json")
    args = parser.parse_args()
    reason = why_not_native()
    ops = None if reason else quantized_matmul_ops(without_avx512=args.avx2)
    if ops is None or not ops.simd_lanes():
        raise SystemExit(f"the quantized kernel cannot run here ({reason or 'no AVX2 / AVX-512 build'})")
    env = environment()
    print_environment(env)
    print(f"kernel path: {ops.simd_lanes()} lanes ({'AVX-512' if ops.simd_lanes() == 16 else 'AVX2'}); uptime: "
          f"{os.popen('uptime').read().strip()}")
    shapes = {s: SHAPES[s] for s in args.shapes}
    cells = []
    for threads in args.threads:
        print(f"\n{threads} thread(s)")
        found = measure(ops, shapes, tuple(args.rows), threads, args.rounds, args.target_ms / 1e3)
        print_table(found)
        cells += found
    env["load_average_end"] = list(os.getloadavg())
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in env['load_average_end'])}")
    write_json(args.json, {"environment": env, "simd_lanes": ops.simd_lanes(), "args": vars(args), "cells": cells,
                           **{f"{v}_beats_dense_up_to_rows": crossovers(cells, v) for v in INTEGER}})


if __name__ == "__main__":
    main()
