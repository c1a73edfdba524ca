"""Batch-1 decode time per token of the bundled SmolLM2 with the GGUF blocks read by the
float32-activation kernel against the int8 and int16 ones (QuantizedLinear's `activations`), in
one process, alternating every round, one prompt of ~100 tokens and --tokens new ones (greedy,
EOS ignored). Prints medians; writes the raw per-round figures as JSON. Run:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/quantized_matmul_e2e.py [--threads 1]

BLOCKSERVE_NATIVE_ISA=avx2 measures the AVX2 kernels (add ATEN_CPU_CAPABILITY=avx2 to hold torch there too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from blockserve import LLM, SamplingParams
from blockserve.native.extension import quantized_matmul_ops
from blockserve.attention.paged_attention import BACKENDS
from blockserve.bench.common import environment, print_environment, write_json
from blockserve.models.loader import load_model
from blockserve.models.quantized_linear import ACTIVATIONS, KERNELS, MAX_ROWS, QuantizedLinear


def use_activations(model: torch.nn.Module, activations: str) -> int:
    """Switch every QuantizedLinear of `model` to `activations`' kernel and crossover; how many. The
    decode stack built over the old ones (models/llama_decode.py's native_stack keeps it on the
    layers) is dropped, so the next step builds it over the new ones."""
    ops = quantized_matmul_ops()
    for module in model.modules():
        module.__dict__.pop("_native_stack", None)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.activations = activations
        layer.kernel = getattr(ops, KERNELS[activations])
        layer.max_rows = MAX_ROWS[activations, ops.simd_lanes()]
    return len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per round")
    parser.add_argument("--json", default="results/quantized_matmul_e2e.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, BACKENDS["exact"])
    llm = LLM(loaded, max_model_len=512, kv_cache_memory="64MiB", enable_prefix_caching=False)
    model = loaded.model
    if not use_activations(model, "float32"):
        raise SystemExit("the model has no GGUF blocks in use (no native kernel here?)")
    env = environment()
    print_environment(env)
    prompt = list(range(1000, 1100))
    ms: dict[str, list[float]] = {activations: [] for activations in ACTIVATIONS}
    for i in range(args.rounds + 1):
        for activations in ms:
            use_activations(model, activations)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            prefill = time.perf_counter() - start
            params = SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            per_token = (time.perf_counter() - start - prefill) / args.tokens * 1e3
            if i:  # the first round warms up
                ms[activations].append(per_token)
    medians = {k: statistics.median(v) for k, v in ms.items()}
    print(f"batch-1 decode, {args.threads} thread(s), median of {args.rounds} alternating rounds "
          f"of {args.tokens} tokens:")
    for k, v in medians.items():
        print(f"  {k:<8} {v:6.2f} ms/token  (rounds: {' '.join(f'{x:.1f}' for x in ms[k])})")
    for k in ACTIVATIONS[1:]:
        print(f"  {k} is {medians['float32'] / medians[k]:.2f}x as fast as float32")
    print(f"  load average {os.getloadavg()}")
    env["load_average_end"] = list(os.getloadavg())
    write_json(args.json, {"environment": env, "args": vars(args), "ms_per_token": ms, "median_ms": medians})


if __name__ == "__main__":
    main()
