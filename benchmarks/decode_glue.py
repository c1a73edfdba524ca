"""A decode step of the bundled SmolLM2 four ways, in one process, rounds alternating, medians:

    native stack  what the engine runs where every layer is on GGUF blocks at the step's row count:
                  the whole decoder stack in one native call (csrc/decode_stack.h)
    flat loop     the layers' native calls from one Python loop (models/llama_decode.py)
    module path   the same calls through the module tree, with the fused decode attention
                  (attention/rotary_decode.py: rotary + KV write + attention in one native call per layer)
    reference     the module tree without the fused decode attention (rotary_, index_copy_ x 2, the
                  backend's decode kernel)

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_glue.py --running 1 16 [--threads 1]
        [--kv-cache-dtype float16] [--quantized-activations int8] [--json results/decode_glue.json]

Each figure carries the other processes' CPU share while it was taken (benchmarks/cpu_share.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_share import CpuShare  # noqa: E402

from blockserve.attention.paged_attention import BACKENDS  # noqa: E402
from blockserve.bench.common import environment, write_json  # noqa: E402
from blockserve.engine.llm import LLM  # noqa: E402
from blockserve.models import llama, llama_decode  # noqa: E402
from blockserve.models.llama import LlamaAttention  # noqa: E402
from blockserve.models.loader import load_model  # noqa: E402
from blockserve.sampling_params import SamplingParams  # noqa: E402


def decoding_engine(loaded, running: int, steps: int, kv_cache_dtype: str, sampling: dict | None = None, **engine_args):
    """An engine with `running` requests past their prefill, with room for `steps` more tokens each;
    greedy unless `sampling` says otherwise (SamplingParams fields)."""
    llm = LLM(loaded, kv_cache_dtype=kv_cache_dtype, **engine_args)
    engine = llm.engine
    params = SamplingParams(**{"temperature": 0, **(sampling or {}), "max_tokens": steps + 64, "ignore_eos": True})
    for i in range(running):
        engine.add_request(f"r{i}", [1 + (7 * i + j) % 500 for j in range(48 + 5 * i)], params)
    started: set[str] = set()
    while len(started) < running:  # until every request has its first token (chunked prefill)
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    for _ in range(4):  # every request decoding, the decode path warm
        engine.step()
    return llm


NATIVE_STACK = llama_decode.native_stack
VARIANTS = ("native stack", "flat loop", "module path", "reference")


def set_variant(model, variant: str, flat_loop) -> None:
    """Switch the engine's model to `variant` (flat_loop: llama_decode.decode_layers)."""
    llama.decode_layers = flat_loop if variant in ("native stack", "flat loop") else (lambda *args: None)
    llama_decode.native_stack = NATIVE_STACK if variant == "native stack" else (lambda *args: None)
    for module in model.modules():
        if isinstance(module, LlamaAttention) and not module.qk_norm:
            module.rotary_decode = None if variant == "reference" else module._rotary_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="decode steps per variant per round")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantized-activations", default="float32", choices=("float32", "int8"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {"environment": environment(), "args": vars(args), "batches": []}
    loaded = load_model(None, BACKENDS["exact"], quantized_activations=args.quantized_activations)
    model = loaded.model
    flat_loop = llama.decode_layers
    for running in args.running:
        llm = decoding_engine(loaded, running, 2 * args.rounds * args.steps, args.kv_cache_dtype)
        for module in model.modules():
            if isinstance(module, LlamaAttention):
                module._rotary_decode = module.rotary_decode
        times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        shares: dict[str, list[float]] = {k: [] for k in times}
        for _ in range(args.rounds):
            for variant in times:
                set_variant(model, variant, flat_loop)
                walls = []
                with CpuShare() as share:
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        llm.engine.step()
                        walls.append(time.perf_counter() - start)
                times[variant].append(statistics.median(walls))
                shares[variant].append(share.others or 0.0)
        set_variant(model, "native stack", flat_loop)
        row = {"running": running, **{f"{k} step ms": 1e3 * statistics.median(v) for k, v in times.items()},
               "others_cpu_share": statistics.median(x for v in shares.values() for x in v)}
        results["batches"].append(row)
        base = row["native stack step ms"]
        print(f"{running:3d} running: " + ", ".join(f"{k} {row[f'{k} step ms']:7.2f} ms/step ({row[f'{k} step ms'] / base:.2f}x)"
                                                   for k in VARIANTS)
              + f"; others' CPU share {100 * row['others_cpu_share']:.0f}%  [{args.threads} thread(s), kv {args.kv_cache_dtype}]")
        del llm
    write_json(args.json, results)


if __name__ == "__main__":
    main()
