"""Two builds of the native kernels side by side: csrc/ at a git revision against the working tree,
both compiled here with the engine's flags, loaded into one process, rounds alternating which build
goes first. Medians, the working tree's speed-up, and the largest difference between the two
builds' outputs (0 where the arithmetic is unchanged). Two kernels:

    matmul     SmolLM2-135M's matmul shapes over GGUF blocks (float32 activations), microseconds
    attention  the paged decode attention on benchmarks/decode_kernels.py's problem (64 sequences
               of 60-245 tokens, SmolLM2's heads), float32 and float16 caches, their blocks in
               random order (as a cache that has recycled blocks holds them) and in order, 30
               layers' caches read in turn (from DRAM): milliseconds per layer

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/kernel_builds_ab.py --base HEAD [--avx2]
        [--kernel matmul|attention] [--threads 1 2] [--rows 1 8 16 64] [--shapes qkv o gate_up down]
        [--rounds 7] [--json F]

--avx2 compiles both with -mno-avx512f (the path a CPU without AVX-512 runs).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_kernels import BLOCK, HEAD, LAYERS, decode_problem, timed  # noqa: E402
from quantized_matmul import SHAPES, layer  # noqa: E402

from blockserve.native import extension as native  # noqa: E402
from blockserve.native.extension import PagedDecodeKernel  # noqa: E402
from blockserve.bench.common import environment, print_environment, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CSRC = Path("blockserve/attention/csrc")


def checkout_csrc(revision: str, into: Path) -> Path:
    """csrc/ as it was at `revision`, unpacked under `into`."""
    archive = subprocess.run(["git", "archive", revision, str(CSRC)], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / CSRC


def build(csrc: Path, tag: str, flags: list[str]):
    from torch.utils.cpp_extension import load

    identity = b"".join(p.read_bytes() for p in sorted(csrc.iterdir())) + " ".join(flags).encode()
    return load(name=f"kernel_ab_{tag}_{hashlib.sha256(identity).hexdigest()[:12]}",
                sources=[str(csrc / s) for s in native.SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(csrc)], verbose=False)


def timed_us(module, args: tuple, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        module.quantized_matmul(*args)
    return (time.perf_counter() - start) / calls * 1e6


def matmul_cells(builds: dict, args) -> list[dict]:
    cells = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in args.shapes:
            in_features, out_features, format = SHAPES[shape]
            packed, _ = layer(in_features, out_features, format)
            for rows in args.rows:
                call = (torch.randn(rows, in_features), packed, out_features, format == "Q4_1")
                outputs = {name: module.quantized_matmul(*call) for name, module in builds.items()}
                calls = max(5, int(args.target_ms / 1e3 / (timed_us(builds["base"], call, 3) / 1e6)))
                times = alternating(builds, args.rounds, lambda module: timed_us(module, call, calls))
                base, tree = statistics.median(times["base"]), statistics.median(times["tree"])
                difference = (outputs["base"] - outputs["tree"]).abs().max().item()
                cells.append({"threads": threads, "shape": shape, "rows": rows, "base_us": base, "tree_us": tree,
                              "speedup": base / tree, "max_abs_difference": difference, "times_us": times})
                print(f"{threads}t {shape:8s} rows {rows:4d}  base {base:8.1f} us  tree {tree:8.1f} us  "
                      f"{base / tree:5.2f}x  max|base-tree| {difference:.2e}", flush=True)
    return cells


def alternating(builds: dict, rounds: int, timed) -> dict[str, list[float]]:
    """`timed(build)` per build, `rounds` times, the order alternating: {name: [per round]}."""
    times = {name: [] for name in builds}
    for round_ in range(rounds):
        for name in (("base", "tree") if round_ % 2 == 0 else ("tree", "base")):
            times[name].append(timed(builds[name]))
    return times


def in_order(table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The block table with each sequence's blocks consecutive, the sequences one after another."""
    ordered, first = torch.zeros_like(table), 1
    for i, blocks in enumerate(((lens + BLOCK - 1) // BLOCK).tolist()):
        ordered[i, :blocks] = torch.arange(first, first + blocks)
        first += blocks
    return ordered


def attention_cells(builds: dict, args) -> list[dict]:
    lens, table, caches, q, out, starts = decode_problem()
    kernels = {name: PagedDecodeKernel(module) for name, module in builds.items()}
    cells = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.float16):
            layers = [(k.to(dtype), v.to(dtype)) for k, v in caches]
            for order, blocks in (("random", table), ("in order", in_order(table, lens))):
                def run(kernel, blocks=blocks, layers=layers):
                    for k, v in layers:
                        kernel(out, q, k, v, blocks, starts, lens, HEAD**-0.5)

                outputs = {}
                for name, kernel in kernels.items():
                    run(kernel)
                    outputs[name] = out.clone()
                times = alternating(kernels, args.rounds, lambda kernel: timed(lambda: run(kernel), 3) / LAYERS * 1e3)
                base, tree = statistics.median(times["base"]), statistics.median(times["tree"])
                difference = (outputs["base"] - outputs["tree"]).abs().max().item()
                cells.append({"threads": threads, "cache": str(dtype).removeprefix("torch."), "blocks": order,
                              "base_ms": base, "tree_ms": tree, "speedup": base / tree,
                              "max_abs_difference": difference, "times_ms": times})
                print(f"{threads}t {cells[-1]['cache']:8s} blocks {order:8s}  base {base:6.3f} ms  tree {tree:6.3f} ms"
                      f"  {base / tree:5.2f}x  max|base-tree| {difference:.2e}", flush=True)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision whose csrc/ is the baseline")
    parser.add_argument("--avx2", action="store_true", help="both builds with -mno-avx512f")
    parser.add_argument("--kernel", choices=["matmul", "attention"], default="matmul")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                        default=["qkv", "o", "gate_up", "down"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--target-ms", type=float, default=150.0, help="time per build per round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    flags = [*native._CFLAGS, *(native.AVX2_ONLY if args.avx2 else ())]
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": build(checkout_csrc(args.base, Path(tmp)), "base", flags),
                  "tree": build(ROOT / CSRC, "tree", flags)}
    env = environment()
    print_environment(env)
    print(f"base {args.base} against the working tree; lanes {builds['tree'].simd_lanes()}")
    cells = (attention_cells if args.kernel == "attention" else matmul_cells)(builds, args)
    write_json(args.json, {"environment": env, "args": vars(args), "cells": cells})


if __name__ == "__main__":
    main()
