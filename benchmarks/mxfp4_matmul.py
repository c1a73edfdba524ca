"""One gpt-oss-20b expert projection (gate_up: [5760, 2880]) as MXFP4 read in place
(csrc/mxfp4.cpp) against float32 torch.matmul over the dequantised weight, per call, at a few row
counts; with the weight bytes each reads and the other processes' CPU share.

    python -m benchmarks.mxfp4_matmul [--threads 1] [--rows 1 16 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.cpu_share import CpuShare
from blockserve.models.mxfp4 import dequantize_mxfp4
from blockserve.native.extension import mxfp4_ops

N, K = 5760, 2880


def seconds_per_call(fn, min_seconds: float = 0.5) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        fn()
        calls += 1
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = mxfp4_ops()
    if ops is None:
        raise SystemExit("native kernels are not built here")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(119, 127, (N, K // 32), dtype=torch.uint8, generator=gen)
    weight = dequantize_mxfp4(blocks, scales)
    print(f"[{N}, {K}] weight: MXFP4 {(blocks.nbytes + scales.nbytes) / 2**20:.1f} MiB, "
          f"float32 {weight.nbytes / 2**20:.1f} MiB; {args.threads} thread(s)")
    print("rows  mxfp4 ms  float32 ms  others' CPU share")
    for rows in args.rows:
        x = torch.randn(rows, K, generator=gen)
        with CpuShare() as share:
            ours = seconds_per_call(lambda: ops.mxfp4_matmul(x, blocks, scales))
            theirs = seconds_per_call(lambda: F.linear(x, weight))
        others = "n/a" if share.others is None else f"{share.others:.0%}"
        print(f"{rows:4d}  {ours * 1e3:8.3f}  {theirs * 1e3:10.3f}  {others}")


if __name__ == "__main__":
    main()
