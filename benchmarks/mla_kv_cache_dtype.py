"""One MLA layer's decode step over a float32, int8 or fp8 latent cache (attention/latent_quant.py)
on the CPU, at DeepSeek-V3's widths: 128 heads, kv_lora_rank 512, rope dim 64, nope and value
dims 128, blocks of 16 tokens.

    python -m benchmarks.mla_kv_cache_dtype [--contexts 1024 4096] [--batches 1 8] [--backends exact whole_block]

Per (backend, context, batch): the median of --rounds x --repeats timed calls of the backend's
forward (the step's row written, the cache gathered, dequantised when quantized, attended), the
dtypes interleaved round by round so the machine's load falls on each alike; the gather indices are
built once per step (the engine shares them across layers) and so are outside the timing. Prints
one JSON line per figure with the bytes each token's row takes, the CPU's vector flags and the
other processes' share of the CPUs while it ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.cpu_share import CpuShare
from benchmarks.half_weights import cpu_flags
from blockserve.attention import latent_quant
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.mla import MLA_BACKENDS
from blockserve.kv.specs import MLASpec

HEADS, NOPE, ROPE, VALUE, RANK, BLOCK = 128, 128, 64, 128, 512, 16
DTYPES = {"float32": torch.float32, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
STORED = {"float32": "float32", "int8": "int8", "fp8": "float8_e4m3fn"}


def step(backend_name: str, dtype: torch.dtype, context: int, batch: int):
    """(a call running the layer's decode step, the cache) for `batch` sequences of `context` tokens."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    cache = torch.zeros(batch * per_seq + 1, BLOCK, latent_quant.encode(torch.zeros(RANK), torch.zeros(ROPE),
                                                                        dtype).shape[-1], dtype=dtype)
    for block in range(1, cache.shape[0]):  # written rows: a normalised latent, a rope key
        c, kr = torch.randn(BLOCK, RANK, generator=gen), torch.randn(BLOCK, ROPE, generator=gen)
        cache[block] = latent_quant.encode(c / c.pow(2).mean(-1, keepdim=True).sqrt(), kr, dtype)
    table = torch.arange(1, batch * per_seq + 1).view(batch, per_seq)
    meta = AttentionMetadata.build(BatchLayout.build([1] * batch, [context - 1] * batch), table, BLOCK)
    q_nope, q_rope = torch.randn(batch, HEADS, NOPE, generator=gen), torch.randn(batch, HEADS, ROPE, generator=gen)
    latent, k_rope = torch.randn(batch, RANK, generator=gen), torch.randn(batch, ROPE, generator=gen)
    w_uk = torch.randn(HEADS, NOPE, RANK, generator=gen) / RANK**0.5
    w_uv = torch.randn(HEADS, VALUE, RANK, generator=gen) / RANK**0.5
    backend = MLA_BACKENDS[backend_name]((NOPE + ROPE) ** -0.5)
    return lambda: backend.forward(q_nope, q_rope, latent, k_rope, w_uk, w_uv, cache, meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--backends", nargs="+", default=["exact", "whole_block"], choices=["exact", "whole_block"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    for backend in args.backends:
        for context in args.contexts:
            for batch in args.batches:
                calls = {name: step(backend, dtype, context, batch) for name, dtype in DTYPES.items()}
                times = {name: [] for name in calls}
                with torch.inference_mode(), CpuShare() as share:
                    for call in calls.values():
                        call()  # warm-up: the step's gather indices, built once per step
                    for _ in range(args.rounds):
                        for name, call in calls.items():
                            for _ in range(args.repeats):
                                start = time.perf_counter()
                                call()
                                times[name].append(time.perf_counter() - start)
                base = statistics.median(times["float32"])
                for name, values in times.items():
                    median = statistics.median(values)
                    print(json.dumps({
                        "backend": backend, "context": context, "batch": batch, "dtype": name,
                        "row_bytes": MLASpec(BLOCK, RANK, ROPE, STORED[name]).row_bytes,
                        "median_ms": round(1e3 * median, 3), "vs_float32": round(median / base, 3),
                        "threads": args.threads, "others_cpu_share": share.others, "cpu_flags": flags}), flush=True)


if __name__ == "__main__":
    main()
