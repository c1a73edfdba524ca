"""Where a decode step of the bundled SmolLM2 goes: the engine step against its native calls alone.

One process: the engine decodes `--running` requests on the flat loop (models/llama_decode.py; the
native stack, which the engine runs where it can, is switched off: it is one call); every native call of one step (the GGUF
blocks' matmuls, the fused norms and activation, the fused rotary + attention) is recorded with
its arguments and replayed back to back, rounds alternating with timed engine steps. The gap
between the runner's forward and the replay is Python and dispatch between the calls; the gap
between the step and the forward is scheduling, input preparation and sampling. --by-call also
times each call on its own during one more replay (the same order, so the same cache state) and
prints the totals per kernel and shape (medians over rounds).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_step_split.py [--threads 2] [--running 1 16]
        [--by-call] [--json results/decode_step_split.json]
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

from blockserve.native import extension as native  # noqa: E402
from blockserve.attention.paged_attention import BACKENDS  # noqa: E402
from blockserve.bench.common import environment, write_json  # noqa: E402
from blockserve.models import llama_decode  # noqa: E402
from blockserve.models.loader import load_model  # noqa: E402
from blockserve.models.quantized_linear import QuantizedLinear  # noqa: E402


class CallRecorder:
    """Wraps the native entry points the decode step uses; while `on`, appends (fn, args) per call."""

    def __init__(self, model: torch.nn.Module):
        self.on, self.calls = False, []
        llama_decode.native_stack = lambda *args: None  # the flat loop's calls: the native stack hides them
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                module.kernel = self.wrap(module.kernel)
        fused = llama_decode.fused_ops()
        recorder = self

        class Fused:
            def __getattr__(self, name):
                return recorder.wrap(getattr(fused, name))

        llama_decode.fused_ops = Fused
        rotary_decode = native.PagedDecodeKernel.rotary_decode

        def recorded_rotary_decode(kernel, *args):
            if recorder.on:
                recorder.calls.append((kernel._module.rotary_decode_attention, args))
            return rotary_decode(kernel, *args)

        native.PagedDecodeKernel.rotary_decode = recorded_rotary_decode

    def wrap(self, fn):
        def call(*args):
            if self.on:
                self.calls.append((fn, args))
            return fn(*args)
        return call


def time_each_call(calls: list) -> dict[str, float]:
    """Seconds per kernel and argument shapes, summed over one replay of `calls` in order, each call timed on its own."""
    totals: dict[str, float] = {}
    for fn, call_args in calls:
        shapes = " ".join("x".join(map(str, a.shape)) for a in call_args[:2] if isinstance(a, torch.Tensor))
        name = f"{getattr(fn, '__name__', type(fn).__name__)} {shapes}"
        start = time.perf_counter()
        fn(*call_args)
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10, help="engine steps and replays per round")
    ap.add_argument("--by-call", action="store_true", help="also the replay's time per kernel and shape")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, BACKENDS["exact"])
    recorder = CallRecorder(loaded.model)
    results = {"environment": environment(), "args": vars(args), "batches": []}
    for running in args.running:
        llm = decoding_engine(loaded, running, 2 * args.rounds * args.steps + 2, "auto")
        timings = llm.engine.step_timings()
        recorder.calls, recorder.on = [], True
        llm.engine.step()
        recorder.on = False
        calls = recorder.calls
        steps, replays, forwards, other_phases = [], [], [], []
        by_call: dict[str, list[float]] = {}
        with CpuShare() as share:
            for _ in range(args.rounds):
                for _ in range(args.steps):
                    before = (timings.forward, timings.total)
                    start = time.perf_counter()
                    llm.engine.step()
                    steps.append(time.perf_counter() - start)
                    forwards.append(timings.forward - before[0])
                    other_phases.append(timings.total - before[1] - forwards[-1])
                for _ in range(args.steps):
                    start = time.perf_counter()
                    for fn, call_args in calls:
                        fn(*call_args)
                    replays.append(time.perf_counter() - start)
                if args.by_call:
                    for name, seconds in time_each_call(calls).items():
                        by_call.setdefault(name, []).append(seconds)
        row = {"running": running, "native_calls": len(calls), "step_ms": 1e3 * statistics.median(steps),
               "forward_ms": 1e3 * statistics.median(forwards),
               "other_runner_phases_ms": 1e3 * statistics.median(other_phases),
               "native_calls_alone_ms": 1e3 * statistics.median(replays), "others_cpu_share": share.others}
        if by_call:
            row["by_call_ms"] = dict(sorted(((name, 1e3 * statistics.median(v)) for name, v in by_call.items()),
                                            key=lambda item: -item[1]))
        results["batches"].append(row)
        print(f"{running:3d} running, {args.threads} thread(s): step {row['step_ms']:.2f} ms = forward "
              f"{row['forward_ms']:.2f} (its {len(calls)} native calls alone {row['native_calls_alone_ms']:.2f}) "
              f"+ zeroing, inputs, sampling {row['other_runner_phases_ms']:.2f} + engine "
              f"{row['step_ms'] - row['forward_ms'] - row['other_runner_phases_ms']:.2f}; "
              f"others' CPU share {100 * (share.others or 0):.0f}%", flush=True)
        for name, ms in row.get("by_call_ms", {}).items():
            print(f"    {ms:8.2f} ms  {name}")
        del llm
    write_json(args.json, results)


if __name__ == "__main__":
    main()
