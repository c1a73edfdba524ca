"""What a speculative verification step costs against a plain decode step, on the bundled model at
batch 1, and where the difference goes.

    python -m benchmarks.verify_step [--k 4] [--rounds 3] [--steps 40] [--contexts 256 1024 4096]

Steps: a request continues a repetitive list (n-gram drafts are all accepted) and every draft is
verified (FlatStepCosts: no step-cost rule), so nearly every step scores k + 1 rows; the plain engine
scores 1. Alternating in one process, per step (medians), in the thread's CPU time (what the step
computes, whatever share of the CPU the other processes leave it) and wall time:

    stack      the decoder stack's one native call (every layer's matmuls and attention)
    lm_head    the logits of the step's rows
    rest       the rest of the engine step: scheduling and proposing, inputs, sampling, acceptance

Attention: one layer's paged decode attention (SmolLM2's 9 query heads over 3 KV heads of 64) of
k + 1 rows of one sequence at consecutive lengths, as a verification lays them out (a chain: each K
and V row read once for all the rows, csrc/paged_decode.cpp), against the same rows over a copy of
the blocks per row (each row read on its own, as k + 1 separate decodes are), and one row alone;
median microseconds of a call over 30 layers' worth of calls.

Prints one JSON line per part with the CPU flags and the other processes' CPU share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import torch

from benchmarks.cpu_share import CpuShare
from benchmarks.spec_decode import TASKS
from blockserve import LLM, SamplingParams
from blockserve.bench.common import cpu_simd_flags
from blockserve.models import llama_decode
from blockserve.models.base import CausalLM
from blockserve.native.extension import paged_decode_kernel
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.step_costs import FlatStepCosts

PARTS = ("stack", "lm_head", "rest", "step")


class StepClock:
    """The CPU and wall seconds of the decoder stack's native call and of the logits, per step."""

    def __init__(self) -> None:
        self.cpu = dict.fromkeys(PARTS, 0.0)
        self.wall = dict.fromkeys(PARTS, 0.0)

    def timed(self, part: str, fn, *args):
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.cpu[part] += time.thread_time() - cpu
            self.wall[part] += time.perf_counter() - wall


class TimedStack:
    """A DecodeStack whose `run` the clock times."""

    def __init__(self, stack, clock: StepClock):
        self.stack, self.clock = stack, clock

    def run(self, *args):
        return self.clock.timed("stack", self.stack.run, *args)


def timed_steps(llm: LLM, prompt: str, steps: int, rows: int | None) -> list[tuple[dict, dict]]:
    """(CPU, wall) milliseconds per part of the steps that scored `rows` rows of one request (None:
    every step after the prefill, speculation off)."""
    engine = llm.engine
    clock = StepClock()
    native_stack = llama_decode.native_stack
    compute_logits = CausalLM.compute_logits

    def stack(*args):
        built = native_stack(*args)
        return None if built is None else TimedStack(built, clock)

    engine.add_request("timed", prompt, SamplingParams(temperature=0, max_tokens=steps * 8, ignore_eos=True))
    engine.step()  # the prefill
    samples = []
    with mock.patch.object(llama_decode, "native_stack", stack), \
            mock.patch.object(CausalLM, "compute_logits",
                              lambda model, hidden: clock.timed("lm_head", compute_logits, model, hidden)):
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            drafted = engine.stats().speculation.num_draft_tokens if rows else 0
            clock.cpu, clock.wall = dict.fromkeys(PARTS, 0.0), dict.fromkeys(PARTS, 0.0)
            clock.timed("step", engine.step)
            if rows is None or engine.stats().speculation.num_draft_tokens - drafted == rows - 1:
                for times in (clock.cpu, clock.wall):
                    times["rest"] = times["step"] - times["stack"] - times["lm_head"]
                samples.append(({p: 1000 * s for p, s in clock.cpu.items()},
                                {p: 1000 * s for p, s in clock.wall.items()}))
    engine.abort_request(["timed"])
    while engine.has_unfinished_requests():
        engine.step()
    return samples


def steps_part(args) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    plain = LLM(enable_prefix_caching=False)
    with mock.patch.object(speculator_module, "StepCosts", FlatStepCosts):  # every step verifies all its drafts
        speculative = LLM(enable_prefix_caching=False, speculative_config=spec)
    prompt = TASKS["continue-list"]
    samples: dict[str, list] = {"plain": [], "verify": []}
    with CpuShare() as share:
        for _ in range(args.rounds):
            samples["plain"] += timed_steps(plain, prompt, args.steps, None)
            samples["verify"] += timed_steps(speculative, prompt, args.steps, args.k + 1)
    medians = {name: {clock: {p: statistics.median(s[i][p] for s in steps) for p in PARTS}
                      for i, clock in enumerate(("cpu_ms", "wall_ms"))} for name, steps in samples.items()}
    print(json.dumps({
        "part": "steps", "k": args.k, "steps": {name: len(s) for name, s in samples.items()},
        "plain": {clock: {p: round(v, 2) for p, v in parts.items()} for clock, parts in medians["plain"].items()},
        "verify": {clock: {p: round(v, 2) for p, v in parts.items()} for clock, parts in medians["verify"].items()},
        "cpu_ratio": {p: round(medians["verify"]["cpu_ms"][p] / medians["plain"]["cpu_ms"][p], 2) for p in PARTS},
        "others_cpu_share": None if share.others is None else round(share.others, 2), "cpu_flags": cpu_simd_flags(),
    }), flush=True)


def attention_part(args) -> None:
    kernel = paged_decode_kernel()
    if kernel is None:
        print(json.dumps({"part": "attention", "skipped": "no native kernels"}))
        return
    rows, hq, hkv, dim, block_size = args.k + 1, 9, 3, 64, 16
    for context in args.contexts:
        blocks = -(-(context + rows) // block_size)
        gen = torch.Generator().manual_seed(0)
        k_cache = torch.randn((rows + 1) * blocks, block_size, hkv, dim, generator=gen)
        v_cache = torch.randn((rows + 1) * blocks, block_size, hkv, dim, generator=gen)
        chain = torch.arange(blocks).repeat(rows, 1)  # every row over the same blocks
        copies = torch.arange(rows * blocks).reshape(rows, blocks) + blocks  # each row over a copy of them
        for r in range(rows):
            k_cache[copies[r]], v_cache[copies[r]] = k_cache[:blocks].clone(), v_cache[:blocks].clone()
        q = torch.randn(rows, hq, dim, generator=gen)
        out = torch.empty_like(q)
        starts, lens = torch.zeros(rows, dtype=torch.long), torch.arange(context, context + rows)
        cases = {"chain": (q, chain, starts, lens), "separate": (q, copies, starts, lens),
                 "one_row": (q[:1], chain[:1], starts[:1], lens[:1])}
        micros: dict[str, list[float]] = {name: [] for name in cases}
        with CpuShare() as share:
            for _ in range(args.rounds * 20):
                for name, (query, table, start, length) in cases.items():
                    began = time.thread_time()
                    for _ in range(30):
                        kernel(out[:query.shape[0]], query, k_cache, v_cache, table, start, length, dim ** -0.5)
                    micros[name].append(1e6 * (time.thread_time() - began) / 30)
        chained, separate = (torch.empty_like(q) for _ in range(2))
        kernel(chained, q, k_cache, v_cache, chain, starts, lens, dim ** -0.5)
        kernel(separate, q, k_cache, v_cache, copies, starts, lens, dim ** -0.5)
        median = {name: statistics.median(m) for name, m in micros.items()}
        print(json.dumps({
            "part": "attention", "rows": rows, "context": context,
            **{f"{name}_cpu_us": round(m, 1) for name, m in median.items()},
            "separate_over_chain": round(median["separate"] / median["chain"], 2),
            "same_bits": torch.equal(chained, separate),
            "others_cpu_share": None if share.others is None else round(share.others, 2),
            "cpu_flags": cpu_simd_flags(),
        }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per engine and round")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096],
                        help="the attention part's sequence lengths")
    args = parser.parse_args()
    attention_part(args)
    steps_part(args)


if __name__ == "__main__":
    main()
