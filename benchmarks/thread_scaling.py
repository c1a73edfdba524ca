"""Where a batch-1 decode step's second thread goes, part by part, on a GGUF file's own blocks.

    python -m benchmarks.thread_scaling --model FILE.gguf [--threads 1 2] [--activations int8 float32]
        [--rounds 5] [--steps 24] [--json PATH]

One process per run; per activation form the model is loaded once (its linear layers on the file's
blocks, `--quantized-activations` as given) and every round measures each part at each thread
count in turn (torch's thread count set between them; no thread governor):

    bandwidth  a pure read, torch.sum over 256 MiB of float32: GB/s (the memory's bound at T threads)
    hand-off   100 back-to-back int8 matmuls that split into two tasks of little work (the first
               layer's first weight rows, two of gguf_matmul_int8's 1-row tasks): us per call; at
               T threads minus at one, the task pool's hand-off to a spinning worker and its join
    matmuls    every linear layer's block matmuls of one decode step back to back, one row of x, as
               the decoder stack calls them (native/csrc/decode_stack.cpp), then the LM head alone:
               wall ms, and the process's CPU ms (every thread's, the pool's waiting included)
    huge pages the same matmuls on a copy of those blocks in anonymous memory advised for
               transparent huge pages (MADV_HUGEPAGE; the engine reads them from the file's
               mapping, in 4 KiB pages): what the TLB costs the stream
    step       an engine's batch-1 decode step (a 32-token prompt, greedy): the whole step, the
               decoder stack's one call, the LM head and the rest (scheduling, Python, sampling),
               medians over --steps steps; CPU ms per step of the stepping thread and of the
               others (the task pool's workers, native/csrc/task_pool.h)

A step's parts at T threads over their time at the first thread count say which part does not
scale; the matmuls' CPU time over their wall time says how much of the second thread was used.
Medians over rounds; each cell carries the other processes' CPU share while it was measured
(benchmarks/cpu_share.py), and the run the CPU's SIMD flags.
"""

from __future__ import annotations

import argparse
import json
import mmap
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.cpu_share import CpuShare
from blockserve.bench.common import add_engine_args, environment, load_for_bench, new_engine, print_environment
from blockserve.models import llama_decode
from blockserve.native.extension import fused_ops
from blockserve.sampling_params import SamplingParams

READ_BYTES = 256 << 20
PROMPT = 32


def timed(fn, reps: int) -> tuple[float, float]:
    """(median wall ms, median CPU ms of the whole process) of `reps` calls, after one untimed."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


class StepParts:
    """An engine over `loaded` whose decode steps are timed whole and in parts (the decoder stack's
    call and compute_logits, by wrappers around them)."""

    def __init__(self, config, loaded):
        self.engine, self.model = new_engine(config, loaded), loaded.model
        self.parts: dict[str, list[float]] = {"stack": [], "lm head": []}
        timers = self.parts
        stack_of = llama_decode.native_stack

        class TimedStack:
            def __init__(self, stack):
                self.stack = stack

            def run(self, *args):
                start = time.perf_counter()
                out = self.stack.run(*args)
                timers["stack"].append(time.perf_counter() - start)
                return out

        def native_stack(*args):
            stack = stack_of(*args)
            return None if stack is None else TimedStack(stack)

        llama_decode.native_stack = native_stack
        logits_of = self.model.compute_logits

        def compute_logits(hidden):
            start = time.perf_counter()
            out = logits_of(hidden)
            timers["lm head"].append(time.perf_counter() - start)
            return out

        self.model.compute_logits = compute_logits
        self.vocab = loaded.hf_config.vocab_size
        self.count = 0

    def run(self, steps: int) -> dict:
        """One request decoded for `steps` timed steps (after its prefill and one more step)."""
        self.count += 1
        prompt = [random.randrange(self.vocab) for _ in range(PROMPT)]
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        self.engine.add_request(f"r{self.count}", prompt, params, cache_salt=str(self.count))
        for _ in range(2):
            self.engine.step()
        for part in self.parts.values():
            part.clear()
        whole, own, every = [], [], []
        while self.engine.has_unfinished_requests():
            w, t, c = time.perf_counter(), time.thread_time(), time.process_time()
            self.engine.step()
            whole.append(time.perf_counter() - w)
            own.append(time.thread_time() - t)
            every.append(time.process_time() - c)
        ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
        step, stack, head = ms(whole), ms(self.parts["stack"]), ms(self.parts["lm head"])
        return {"step": step, "stack": stack, "lm head": head, "rest": step - stack - head,
                "cpu stepping thread": ms(own), "cpu other threads": ms(every) - ms(own)}


def linear_matmuls(model, activations: str):
    """(every linear layer's block matmuls of one decode step, one row of x, as the decoder stack
    makes them: each row segment of a fused layer its own call; the LM head's; the hand-off's 100
    calls; the layers' matmuls on huge-page copies of their blocks; the bytes of the layers' and the
    head's blocks)."""
    ops = fused_ops()
    matmul = ops.gguf_matmul_int8 if activations == "int8" else ops.gguf_matmul
    layers = model.model.layers
    linears = [lin for layer in layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    calls = [(torch.randn(1, lin.in_features), seg.raw, seg.format) for lin in linears for seg in lin.segments]
    head = [(torch.randn(1, model.lm_head.in_features), seg.raw, seg.format) for seg in model.lm_head.segments]

    def layers_call(calls=calls):
        for x, raw, fmt in calls:
            matmul(x, raw, fmt)

    def head_call():
        for x, raw, fmt in head:
            matmul(x, raw, fmt)

    x, raw, fmt = calls[0]
    few = raw[:2 * max(1, (1 << 16) // x.shape[1])]  # csrc/gguf_blocks_int8.cpp's rows per task at one row of x

    def handoff_call():
        for _ in range(100):
            ops.gguf_matmul_int8(x, few, fmt)

    huge = on_huge_pages(calls)

    def huge_call():
        layers_call(huge)

    return (layers_call, head_call, handoff_call, huge_call, sum(raw.numel() for _, raw, _ in calls),
            sum(raw.numel() for _, raw, _ in head))


def on_huge_pages(calls: list[tuple]) -> list[tuple]:
    """`calls` with each block tensor copied into one anonymous mapping advised MADV_HUGEPAGE, each
    copy at a 2 MiB boundary (torch.frombuffer's tensors hold the mapping)."""
    align = 2 << 20
    size = sum((raw.numel() + align - 1) // align * align for _, raw, _ in calls) + align
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(buffer, dtype=torch.uint8)
    offset = -memory.data_ptr() % align
    copies = []
    for x, raw, fmt in calls:
        copy = memory[offset:offset + raw.numel()].view(raw.shape)
        copy.copy_(raw)
        copies.append((x, copy, fmt))
        offset += (raw.numel() + align - 1) // align * align
    return copies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file whose linear layers all have block kernels")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--activations", nargs="+", choices=("int8", "float32"), default=["int8", "float32"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    env = environment()
    print_environment(env)
    data = torch.rand(READ_BYTES // 4)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "environment": env, "cells": []}
    for activations in args.activations:
        engine_args = argparse.ArgumentParser()
        add_engine_args(engine_args)
        flags = ["--model", args.model, "--max-model-len", "256", "--kv-cache-memory", "64MiB",
                 "--no-adaptive-threads", "--num-threads", str(max(args.threads))]
        if activations == "int8":
            flags += ["--quantized-activations", "int8"]
        config, loaded = load_for_bench(engine_args.parse_args(flags))
        layers_call, head_call, handoff_call, huge_call, layer_bytes, head_bytes = linear_matmuls(loaded.model,
                                                                                                  activations)
        parts = StepParts(config, loaded)
        cells: dict[int, list[dict]] = {t: [] for t in args.threads}
        for round_ in range(args.rounds):
            for threads in args.threads:
                torch.set_num_threads(threads)
                with CpuShare() as share:
                    read_ms, _ = timed(lambda: data.sum(), 5)
                    handoff_ms, _ = timed(handoff_call, 5)
                    layers_ms, layers_cpu = timed(layers_call, 5)
                    huge_ms, _ = timed(huge_call, 5)
                    head_ms, head_cpu = timed(head_call, 9)
                    step = parts.run(args.steps)
                cell = {"activations": activations, "threads": threads, "round": round_,
                        "read GB/s": READ_BYTES / read_ms / 1e6, "hand-off us": handoff_ms * 10,  # 100 calls
                        "matmuls ms": layers_ms, "matmuls cpu ms": layers_cpu,
                        "matmuls GB/s": layer_bytes / layers_ms / 1e6, "huge pages ms": huge_ms,
                        "lm head ms": head_ms, "lm head cpu ms": head_cpu, "lm head GB/s": head_bytes / head_ms / 1e6,
                        **{f"step {k}": v for k, v in step.items()}, "others": share.others}
                cells[threads].append(cell)
                results["cells"].append(cell)
                print(f"{activations} {threads}t round {round_ + 1}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in cell.items() if isinstance(v, float)), flush=True)
        print(f"\n== {activations}: medians of {args.rounds} rounds (x: over {args.threads[0]} thread's) ==")
        first = {k: statistics.median(c[k] for c in cells[args.threads[0]]) for k in cells[args.threads[0]][0]
                 if isinstance(cells[args.threads[0]][0][k], float)}
        for threads in args.threads:
            line = []
            for key in first:
                values = [c[key] for c in cells[threads] if c[key] is not None]
                if not values:
                    continue
                med = statistics.median(values)
                ratio = (f" ({med / first[key]:.2f}x)" if threads != args.threads[0] and key != "others"
                         and first[key] > 0.01 else "")
                line.append(f"{key} {med:.2f}{ratio}")
            print(f"{threads} thread(s): " + ", ".join(line))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
