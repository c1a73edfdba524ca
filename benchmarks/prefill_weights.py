"""A prompt's prefill on the bundled model's GGUF blocks against the same model on float32 weights
(`quantized_matmul=False`: the float32 copy the many-row side ran on before the tiles), per
native build and prompt length, one thread:

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.prefill_weights [--tokens 64 512] [--isas native avx2]

Each (weights, build) runs in a process of its own (BLOCKSERVE_NATIVE_ISA picks the build), which
generates one greedy token for prompts of random token ids, prefix caching off; a cell is the
fastest of --rounds prompts by the process's CPU time (time.process_time: the time the process
waits while others hold the CPU of a shared machine does not count). Prints one line per cell and
the other processes' CPU share.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

from benchmarks.cpu_share import CpuShare

WEIGHTS = ("blocks", "float32")


def child(weights: str, tokens: list[int], rounds: int) -> dict[int, float]:
    """Fastest prefill seconds per prompt length, in this process."""
    from blockserve import LLM, SamplingParams

    llm = LLM(quantized_matmul=weights == "blocks", num_threads=1, adaptive_threads=False,
              enable_prefix_caching=False)
    params, rng, best = SamplingParams(temperature=0, max_tokens=1), random.Random(0), {}
    for n in tokens:
        best[n] = float("inf")
        for _ in range(rounds):
            prompt = [rng.randrange(100, 40000) for _ in range(n)]
            start = time.process_time()
            llm.generate([prompt], params, use_tqdm=False)
            best[n] = min(best[n], time.process_time() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--isas", nargs="+", choices=("native", "avx2"), default=["native", "avx2"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", choices=WEIGHTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.rounds)))
        return
    with CpuShare() as share:
        for isa in args.isas:
            ms = {}
            for weights in WEIGHTS:
                env = {**os.environ, "BLOCKSERVE_NATIVE_ISA": isa, "OMP_NUM_THREADS": "1"}
                run = subprocess.run([sys.executable, "-m", "benchmarks.prefill_weights", "--child", weights,
                                      "--rounds", str(args.rounds), "--tokens", *map(str, args.tokens)],
                                     env=env, capture_output=True, text=True, check=True)
                ms[weights] = {int(n): s * 1e3 for n, s in json.loads(run.stdout.strip().splitlines()[-1]).items()}
            for n in args.tokens:
                print(f"{isa:6} {n:5} tokens: blocks {ms['blocks'][n]:8.0f} ms  float32 {ms['float32'][n]:8.0f} ms  "
                      f"float32/blocks {ms['float32'][n] / ms['blocks'][n]:.2f}x", flush=True)
    print(f"others' CPU share: {share.others:.0%}" if share.others is not None else "others' CPU share: unknown")


if __name__ == "__main__":
    main()
