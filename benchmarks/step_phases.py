"""Where an engine step of the bundled SmolLM2 goes, phase by phase, on the engine's own path.

One process: the engine decodes `--running` requests (greedy) and every step is timed whole and in
parts, by timers wrapped around the calls that make it up:

    step            LLMEngine.step: scheduling, the model runner, outputs and detokenizing
    prepare         the runner's input preparation (InputBatch.prepare)
    forward         the runner's forward phase: the model, the logits
      layers        decode_layers (models/llama_decode.py): its Python and the call below
        stack       the decoder stack's one native call (csrc/decode_stack.h)
      lm head       compute_logits
    sample          the runner's sampling phase (building the rows' SamplingBatch, the sampler)
      argmax        greedy rows' argmax

Medians per phase over `--steps` steps a round; the differences (step - runner phases, forward -
layers - lm head, layers - stack) are the Python and dispatch around the native work.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/step_phases.py [--threads 2] [--running 1 16]
        [--rounds 3] [--steps 200] [--json results/step_phases.json]

Each round carries the other processes' CPU share while it was taken (benchmarks/cpu_share.py).
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
from decode_glue import decoding_engine  # noqa: E402

from blockserve.attention.paged_attention import BACKENDS  # noqa: E402
from blockserve.bench.common import environment, write_json  # noqa: E402
from blockserve.models import llama, llama_decode  # noqa: E402
from blockserve.models.loader import load_model  # noqa: E402
from blockserve.worker.sampler import Sampler  # noqa: E402

PHASES = ("step", "prepare", "forward", "layers", "stack", "lm head", "sample", "argmax")


class StepTimer:
    """Times the calls of PHASES while `current` is a dict: each wrapped call writes its seconds there."""

    def __init__(self, model: torch.nn.Module):
        self.current: dict[str, float] = {}
        native_stack, decode_layers = llama_decode.native_stack, llama.decode_layers
        timer = self

        class TimedStack:
            def __init__(self, stack):
                self.stack = stack

            def run(self, *args):
                return timer.timed("stack", self.stack.run, *args)

        def stack(*args):
            built = native_stack(*args)
            return None if built is None else TimedStack(built)

        llama_decode.native_stack = stack
        llama.decode_layers = lambda *args: self.timed("layers", decode_layers, *args)
        compute_logits = model.compute_logits
        model.compute_logits = lambda hidden: self.timed("lm head", compute_logits, hidden)
        argmax = getattr(Sampler, "_argmax", None)  # (a module function before the native argmax: not timed)
        if argmax is not None:
            Sampler._argmax = lambda sampler, x: self.timed("argmax", argmax, sampler, x)

    def timed(self, name: str, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="timed engine steps per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, BACKENDS["exact"])
    timer = StepTimer(loaded.model)
    results = {"environment": environment(), "args": vars(args), "batches": []}
    for running in args.running:
        llm = decoding_engine(loaded, running, args.rounds * args.steps + 64, "auto", num_threads=args.threads,
                              adaptive_threads=False)
        engine, runner_timings = llm.engine, llm.engine.step_timings()
        row = {"running": running, "rounds": []}
        for _ in range(args.rounds):
            samples: dict[str, list[float]] = {name: [] for name in PHASES}
            with CpuShare() as share:
                for _ in range(args.steps):
                    before = (runner_timings.prepare, runner_timings.forward, runner_timings.sample)
                    timer.current = {}
                    start = time.perf_counter()
                    engine.step()
                    timer.current["step"] = time.perf_counter() - start
                    timer.current["prepare"] = runner_timings.prepare - before[0]
                    timer.current["forward"] = runner_timings.forward - before[1]
                    timer.current["sample"] = runner_timings.sample - before[2]
                    for name in PHASES:
                        samples[name].append(timer.current.get(name, 0.0))
            medians = {name: 1e3 * statistics.median(values) for name, values in samples.items()}
            medians["others_cpu_share"] = share.others
            row["rounds"].append(medians)
            print(f"{running:3d} running, {args.threads} thread(s), ms: "
                  + " ".join(f"{name} {medians[name]:.3f}" for name in PHASES)
                  + f" | around the stack {medians['layers'] - medians['stack']:.3f}, rest of the forward "
                  f"{medians['forward'] - medians['layers'] - medians['lm head']:.3f}, engine outside the runner "
                  f"{medians['step'] - medians['prepare'] - medians['forward'] - medians['sample']:.3f}; "
                  f"others' CPU share {100 * (share.others or 0):.0f}%", flush=True)
        results["batches"].append(row)
        del llm
    write_json(args.json, results)


if __name__ == "__main__":
    main()
