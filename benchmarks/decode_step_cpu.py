"""The CPU time of a decode step, one thread: the work a step of `--running` requests costs, read
from the thread's own CPU clock (time.thread_time), so time the process waits while other processes
hold the CPU (a shared machine) is not counted, unlike benchmarks.step_profile's wall clock.

    OMP_NUM_THREADS=1 python -m benchmarks.decode_step_cpu --model PATH.gguf [--running 16 64] [--steps 5]
        [--prompt-tokens 8] [--quantized-activations int8]

An engine (one torch thread, so the native kernels' task pool has no workers and the whole step runs
on this thread) decodes `--running` requests past their prefill (greedy, `--prompt-tokens` each: the
decode step's matmuls dominate, not its attention); prints the median and fastest of `--steps` steps'
CPU time, the model's multiply-adds per second at that median (its linear layers and head), and the
other processes' CPU share meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.cpu_share import CpuShare
from benchmarks.step_profile import decoding_engine
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model


def matmul_flops_per_row(model: torch.nn.Module) -> int:
    """2 x the weights of every linear layer and the head: a decode row's multiply-adds, doubled."""
    return 2 * sum(module.in_features * module.out_features for module in model.modules()
                   if hasattr(module, "in_features") and hasattr(module, "out_features"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model file or directory (e.g. a GGUF K-quant mix)")
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--quantized-activations", default="float32", choices=("float32", "int8", "int16"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    for running in args.running:
        loaded = load_model(args.model, BACKENDS["exact"], quantized_activations=args.quantized_activations)
        flops = matmul_flops_per_row(loaded.model) * running
        llm = decoding_engine(loaded, running, args.steps, prompt_tokens=args.prompt_tokens)
        seconds = []
        with CpuShare() as share, torch.inference_mode():
            for _ in range(args.steps):
                start = time.thread_time()
                llm.engine.step()
                seconds.append(time.thread_time() - start)
        median = statistics.median(seconds)
        others = f"{share.others:.0%}" if share.others is not None else "unknown"
        print(f"{running:3} running, {args.quantized_activations}: step CPU {1e3 * median:.0f} ms median of "
              f"{args.steps} (fastest {1e3 * min(seconds):.0f}), {flops / median / 1e9:.0f} GFLOP/s of matmuls; "
              f"others' CPU share {others}", flush=True)
        del llm, loaded


if __name__ == "__main__":
    main()
