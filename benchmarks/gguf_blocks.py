"""x @ W^T over GGUF blocks in the file's layout (csrc/gguf_blocks.cpp) per format, row count and
build, on a layer shape of the bundled model's (random blocks with finite scales), at --threads:

    blocks   gguf_matmul: four weight rows dequantised at a time into register tiles (decode)
    limbs    gguf_matmul_limbs: x taken as four base-255 integer limbs per block of 32 (float32
             activations to float32 rounding, csrc/block_limbs.h), the int8 kernel's integer dots
    int8     gguf_matmul_int8 (--quantized-activations int8): x rounded to int8 per block of 32,
             integer dots with the blocks' levels (csrc/gguf_blocks_int8.cpp)
    tiles    GGUFBlockLinear's many-row path: tiles dequantised from the blocks into torch's GEMM
    float32  a resident float32 copy of the dequantised weights (column-major nn.Linear): what the
             many-row path would run on with a float32 copy

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.gguf_blocks [--rows 1 8 16 64 512] [--formats Q4_K Q6_K] [--threads 2]
        [--variants blocks int8] [--shape 11264x2048]

--shape (out x in) replaces every format's layer shape, e.g. a 0.92B Llama's gate/up (11264x2048) or
down projection (2048x5632): wider layers than the bundled model's, whose weights do not stay in cache.

Each cell is the fastest of --rounds calls, the variants interleaved in every round. At one thread
a call is timed by this thread's CPU time (time.thread_time), so the time the process waits while
other processes hold the CPU (a shared machine) is not counted; at more threads by the wall clock.
`blocks` is timed up to --blocks-max-rows rows. Prints one line per (build, format,
rows), each variant's time over blocks' (or tiles' past --blocks-max-rows), and the other
processes' CPU share while it measured.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.cpu_share import CpuShare
from blockserve.models.gguf_block_linear import SCALE_OFFSETS, block_shape
from blockserve.models.tiled_gemm import tiled_gemm
from blockserve.models.weight_layout import column_major
from blockserve.native.extension import quantized_matmul_ops

SHAPES = {"Q5_0": (1536, 576), "Q4_K": (576, 1536), "Q6_K": (576, 1536), "Q8_0": (1536, 576), "Q2_K": (576, 1536),
          "Q3_K": (576, 1536), "Q5_K": (576, 1536), "Q4_1": (1536, 576), "Q4_0": (1536, 576), "Q5_1": (1536, 576),
          "IQ4_NL": (1536, 576), "IQ4_XS": (576, 1536)}
DEFAULT_FORMATS = ("Q5_0", "Q4_K", "Q6_K", "Q8_0")
VARIANTS = ("blocks", "limbs", "int8", "tiles", "float32")


def blocks(format: str, rows: int, columns: int, rng: np.random.Generator) -> torch.Tensor:
    values, nbytes = block_shape(format)
    raw = rng.integers(0, 256, (rows * columns // values, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[format]:
        raw[:, offset:offset + 2] = rng.uniform(-1e-2, 1e-2, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def shape(text: str) -> tuple[int, int]:
    """'OUTxIN' -> (out, in)."""
    try:
        out, inp = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected OUTxIN, e.g. 11264x2048") from None
    if out <= 0 or inp <= 0:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: both sizes must be positive")
    return out, inp


def fastest_ms(fns: dict, rounds: int, clock=time.perf_counter) -> dict[str, float]:
    """The fastest of `rounds` calls of each function by `clock`, the functions interleaved in every round."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--formats", nargs="+", choices=list(SHAPES), default=list(DEFAULT_FORMATS))
    ap.add_argument("--builds", nargs="+", choices=("native", "avx2"), default=["native", "avx2"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--blocks-max-rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--shape", type=shape, default=None, help="out x in, e.g. 11264x2048 (default: per format)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    with CpuShare() as share, torch.inference_mode():
        for build in args.builds:
            ops = quantized_matmul_ops(without_avx512=build == "avx2")
            for format in args.formats:
                n, k = args.shape or SHAPES[format]
                raw = blocks(format, n, k, rng)
                weight = column_major(ops.gguf_dequantize(raw, format, k))
                for m in args.rows:
                    x = torch.randn(m, k)
                    fns = {"blocks": lambda: ops.gguf_matmul(x, raw, format),
                           "limbs": lambda: ops.gguf_matmul_limbs(x, raw, format),
                           "int8": lambda: ops.gguf_matmul_int8(x, raw, format),
                           "tiles": lambda: tiled_gemm(x, n, k, lambda s, c: ops.gguf_dequantize(raw[s:s + c], format, k)),
                           "float32": lambda: torch.nn.functional.linear(x, weight)}
                    fns = {v: fn for v, fn in fns.items() if v in args.variants
                           and (v != "blocks" or m <= args.blocks_max_rows)}
                    ms = fastest_ms(fns, args.rounds, time.thread_time if args.threads == 1 else time.perf_counter)
                    cells = "  ".join(f"{v} {ms[v]:8.3f}" if v in ms else f"{v} {'-':>8}" for v in args.variants)
                    base = "blocks" if "blocks" in ms else "tiles" if "tiles" in ms else None
                    ratios = "  ".join(f"{v}/{base} {ms[v] / ms[base]:.2f}x" for v in ms if base and v != base)
                    print(f"{build:6} {args.threads}t {format:6} {n}x{k} rows {m:4}: {cells} ms  {ratios}", flush=True)
    print(f"others' CPU share: {share.others:.0%}" if share.others is not None else "others' CPU share: unknown")


if __name__ == "__main__":
    main()
