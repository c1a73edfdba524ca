"""Where a decode step's time goes: an engine step timed whole and in phases, per decode path and
batch size.

One process: an engine decodes `--running` requests past their prefill (greedy unless --sampled),
and every step is timed whole and in parts, by timers wrapped around the calls that make it up:

    step            LLMEngine.step
      schedule      Scheduler.schedule
      prepare       the runner's zero and prepare phases: its rows updated, the step's inputs built
      forward       the runner's forward phase
        model       the model's forward and compute_logits (the only device work of a decode step)
          layers    decode_layers (models/llama_decode.py): the flat loop, or the call below
            stack   the decoder stack's one native call (native/csrc/decode_stack.h)
          lm head   compute_logits
      sample        the runner's sample phase: the rows' SamplingBatch, the sampler, the tokens recorded
        argmax      greedy rows' argmax
      update        Scheduler.update_from_output (stop checks, prefix-cache registration)
    host            step - model: the work a GPU's host must overlap with the device
      rest          host - schedule - prepare - sample - update (the engine's outputs, the runner's
                    other bookkeeping; with --graphs the graph's static inputs)

Models (--model):
    bundled   the bundled SmolLM2 (GGUF blocks, native kernels): the CPU's decode step; or a path
              (a GGUF file, e.g. a K-quant mix), run as the bundled one
    tiny      a 1-layer, 64-wide random Llama whose forward costs next to nothing: the host's work,
              as the GPU path sees it

Decode paths (--paths), in one process, rounds alternating between them:
    native-stack  the engine's own: where every layer is on GGUF blocks at the step's row count, the
                  decoder stack in one native call, without the GIL
    flat-loop     the same layers' native calls from one Python loop
    module        the module tree, with the fused decode attention (rotary + KV write + attention in
                  one native call per layer, attention/rotary_decode.py)
    reference     the module tree without it (rotary, KV writes, the backend's decode kernel)

--native-calls records the flat loop's native calls of one step (the GGUF matmuls, the fused norms
and activation, the fused attention) with their arguments, and replays them back to back every
round: the calls alone, against the forward (the gap is Python and dispatch between them);
--by-call also times each call of one more replay, per kernel and shape. --top-ops N profiles one
more pass per path (torch.profiler) and prints the N aten ops of most self time a step.

Medians over `--steps` steps a round, then over rounds; each round carries the other processes'
CPU share while it was taken (benchmarks/cpu_share.py).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.step_profile [--model bundled|tiny] [--threads 2]
        [--running 1 16] [--paths native-stack flat-loop module reference] [--rounds 3] [--steps 50]
        [--kv-cache-dtype float16] [--quantized-activations int8] [--sampled] [--async-scheduling]
        [--prefix-caching] [--graphs] [--max-model-len N] [--native-calls [--by-call]] [--top-ops N]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks.cpu_share import CpuShare
from blockserve.attention.paged_attention import BACKENDS
from blockserve.bench.common import environment, write_json
from blockserve.engine.llm import LLM
from blockserve.models import llama, llama_decode
from blockserve.models.llama import LlamaAttention
from blockserve.models.loader import load_model
from blockserve.models.quantized_linear import QuantizedLinear
from blockserve.native import extension as native
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler import Scheduler
from blockserve.worker.cuda_graphs import default_graph_sizes
from blockserve.worker.sampler import Sampler

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
TINY_PROMPT_TOKENS = 32
PHASES = ("step", "schedule", "prepare", "forward", "model", "layers", "stack", "lm head", "sample", "argmax",
          "update", "host", "rest")
PATHS = ("native-stack", "flat-loop", "module", "reference")
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.9)
FLAT_LOOP, NATIVE_STACK = llama.decode_layers, llama_decode.native_stack  # the engine's own


def decoding_engine(loaded, running: int, steps: int, kv_cache_dtype: str = "auto", sampling: dict | None = None,
                    prompt_tokens: int | None = None, **engine_args) -> LLM:
    """An engine with `running` requests past their prefill, with room for `steps` more tokens each;
    greedy unless `sampling` says otherwise (SamplingParams fields). Request i's prompt has
    `prompt_tokens` tokens, or 48 + 5i."""
    llm = LLM(loaded, kv_cache_dtype=kv_cache_dtype, **engine_args)
    engine = llm.engine
    params = SamplingParams(**{"temperature": 0, **(sampling or {}), "max_tokens": steps + 64, "ignore_eos": True})
    for i in range(running):
        length = prompt_tokens or 48 + 5 * i
        engine.add_request(f"r{i}", [1 + (7 * i + j) % 500 for j in range(length)], params)
    started: set[str] = set()
    while len(started) < running:  # until every request has its first token (chunked prefill)
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    for _ in range(4):  # every request decoding, the decode path warm
        engine.step()
    return llm


class StepTimer:
    """Times the calls of PHASES: each wrapped call adds its seconds to `current` (the scheduler's and the
    sampler's methods patched on their classes, the model's on the instance); `set_path` switches the
    decode path, its layers and stack timed."""

    def __init__(self, model: torch.nn.Module):
        self.current: dict[str, float] = {}
        self.model = model
        Scheduler.schedule = self.timing("schedule", Scheduler.schedule)
        Scheduler.update_from_output = self.timing("update", Scheduler.update_from_output)
        Sampler._argmax = self.timing("argmax", Sampler._argmax)
        model.forward = self.timing("model", model.forward)  # an instance attribute: shadows the method
        model.compute_logits = self.timing("model", self.timing("lm head", model.compute_logits))
        self.layers = self.timing("layers", FLAT_LOOP)
        self.fused_attention = {m: m.rotary_decode for m in model.modules() if isinstance(m, LlamaAttention)}

    def timing(self, phase: str, call: Callable) -> Callable:
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - began
        return timed

    def stack(self, *args):
        built = NATIVE_STACK(*args)
        return None if built is None else TimedStack(built, self.timing("stack", built.run))

    def set_path(self, path: str) -> None:
        llama.decode_layers = self.layers if path in ("native-stack", "flat-loop") else (lambda *args: None)
        llama_decode.native_stack = self.stack if path == "native-stack" else (lambda *args: None)
        for module, fused in self.fused_attention.items():
            module.rotary_decode = None if path == "reference" else fused


class TimedStack:
    def __init__(self, stack, run: Callable):
        self.stack, self.run = stack, run


class CallRecorder:
    """Wraps the native entry points of the flat loop; while `on`, appends (fn, args) per call."""

    def __init__(self, model: torch.nn.Module):
        self.on, self.calls = False, []
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                module.kernel = self.wrap(module.kernel)
        fused, recorder = llama_decode.fused_ops(), self

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

    def record(self, engine) -> list:
        """The native calls of one engine step."""
        self.calls, self.on = [], True
        engine.step()
        self.on = False
        return self.calls


def replay(calls: list) -> None:
    for fn, args in calls:
        fn(*args)


def time_each_call(calls: list) -> dict[str, float]:
    """Seconds per kernel and argument shapes, summed over one replay of `calls` in order, each call timed on its own."""
    totals: dict[str, float] = {}
    for fn, args in calls:
        shapes = " ".join("x".join(map(str, a.shape)) for a in args[:2] if isinstance(a, torch.Tensor))
        name = f"{getattr(fn, '__name__', type(fn).__name__)} {shapes}"
        began = time.perf_counter()
        fn(*args)
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - began
    return totals


def capture_host_side_only(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for CUDA graph capture on the CPU (`--graphs`): the forward runs once, at capture, and a
    replay computes nothing (on a GPU the device runs it), so a decode step takes the graph path's host
    work only, its static inputs built and copied. The sampled tokens are then meaningless; nothing here
    reads them."""
    return (lambda: None), forward()


def timed_steps(engine, timer: StepTimer, steps: int) -> tuple[dict[str, list[float]], float | None]:
    """Every phase's seconds per step over `steps` engine steps, and the others' CPU share meanwhile."""
    runner = engine.step_timings()
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    with CpuShare() as share:
        for _ in range(steps):
            before = (runner.zero + runner.prepare, runner.forward, runner.sample)
            timer.current = {}
            began = time.perf_counter()
            engine.step()
            parts = dict(timer.current, step=time.perf_counter() - began)
            parts.update(prepare=runner.zero + runner.prepare - before[0], forward=runner.forward - before[1],
                         sample=runner.sample - before[2])
            parts["host"] = parts["step"] - parts.get("model", 0.0)
            parts["rest"] = parts["host"] - sum(parts.get(p, 0.0) for p in ("schedule", "prepare", "sample", "update"))
            for phase in PHASES:
                samples[phase].append(parts.get(phase, 0.0))
    return samples, share.others


def top_ops(engine, steps: int, count: int) -> list[dict]:
    """The `count` aten ops of most self CPU time a step, over `steps` profiled engine steps."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    ops = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()
           if e.key.startswith("aten::")]
    return [{"op": op, "ms": ms, "calls": calls} for op, ms, calls in sorted(ops, key=lambda o: -o[1])[:count]]


def load(args, tmp: str):
    backend = BACKENDS["flex" if args.graphs else "exact"]  # exact's decode cannot be captured
    if args.model != "tiny":
        return load_model(None if args.model == "bundled" else args.model, backend,
                          quantized_activations=args.quantized_activations)
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(tmp)
    return load_model(tmp, backend)


def profile(args, loaded, timer: StepTimer, recorder: CallRecorder | None, running: int) -> dict:
    """One batch size: per path the phases' medians per round, their medians over rounds, the native
    calls alone and by call where asked."""
    passes = args.rounds * len(args.paths) * args.steps + (args.steps * len(args.paths) if args.top_ops else 0) + 1
    engine_args = dict(num_threads=args.threads, adaptive_threads=False, async_scheduling=args.async_scheduling)
    if args.prefix_caching is not None:
        engine_args["enable_prefix_caching"] = args.prefix_caching
    if args.model == "tiny":
        engine_args.update(device="cpu", block_size=16, kv_cache_memory="64MiB", max_num_seqs=max(running, 1),
                           max_model_len=args.max_model_len or TINY_PROMPT_TOKENS + passes + 96)
        engine_args.setdefault("enable_prefix_caching", False)
    elif args.max_model_len:
        engine_args["max_model_len"] = args.max_model_len
    llm = decoding_engine(loaded, running, passes, args.kv_cache_dtype, SAMPLED if args.sampled else None,
                          TINY_PROMPT_TOKENS if args.model == "tiny" else None, **engine_args)
    engine = llm.engine
    if args.graphs:
        engine.capture_decode_graphs(default_graph_sizes(running), capture_host_side_only)
    row: dict = {"running": running, "paths": {path: {"rounds": []} for path in args.paths}}
    calls, replays, by_call = [], [], {}
    if recorder is not None:
        timer.set_path("flat-loop")
        calls = recorder.record(engine)
        row["native_calls"] = len(calls)
    for _ in range(args.rounds):
        for path in args.paths:
            timer.set_path(path)
            samples, others = timed_steps(engine, timer, args.steps)
            row["paths"][path]["rounds"].append({
                "ms": {phase: round(1e3 * statistics.median(v), 4) for phase, v in samples.items()},
                "host_mean_ms": round(1e3 * statistics.fmean(samples["host"]), 4), "others_cpu_share": others})
        if calls:
            with CpuShare() as share:
                for _ in range(args.steps):
                    began = time.perf_counter()
                    replay(calls)
                    replays.append(time.perf_counter() - began)
            row.setdefault("native_calls_others_cpu_share", []).append(share.others)
            if args.by_call:
                for name, seconds in time_each_call(calls).items():
                    by_call.setdefault(name, []).append(seconds)
    for path in args.paths:
        rounds = row["paths"][path]["rounds"]
        row["paths"][path]["ms"] = {phase: round(statistics.median(r["ms"][phase] for r in rounds), 4)
                                    for phase in PHASES}
        if args.top_ops:
            timer.set_path(path)
            row["paths"][path]["top_ops"] = top_ops(engine, args.steps, args.top_ops)
    if replays:
        row["native_calls_alone_ms"] = round(1e3 * statistics.median(replays), 4)
    if by_call:
        row["by_call_ms"] = dict(sorted(((name, 1e3 * statistics.median(v)) for name, v in by_call.items()),
                                        key=lambda item: -item[1]))
    timer.set_path("native-stack")
    del llm
    return row


def report(row: dict, threads: int) -> None:
    for path, result in row["paths"].items():
        ms, shares = result["ms"], [r["others_cpu_share"] or 0.0 for r in result["rounds"]]
        print(f"{row['running']:4d} running, {path}, {threads} thread(s): step {ms['step']:.3f} ms = model "
              f"{ms['model']:.3f} (layers {ms['layers']:.3f} [stack {ms['stack']:.3f}], lm head {ms['lm head']:.3f}) "
              f"+ host {ms['host']:.3f} (schedule {ms['schedule']:.3f}, prepare {ms['prepare']:.3f}, sample "
              f"{ms['sample']:.3f} [argmax {ms['argmax']:.3f}], update {ms['update']:.3f}, rest {ms['rest']:.3f}); "
              f"others' CPU share {100 * statistics.median(shares):.0f}%", flush=True)
        for op in result.get("top_ops", []):
            print(f"    {op['ms']:8.3f} ms  {op['calls']:6.1f} calls  {op['op']}")
    if "native_calls_alone_ms" in row:
        print(f"    the flat loop's {row['native_calls']} native calls alone: {row['native_calls_alone_ms']:.3f} ms")
    for name, ms in row.get("by_call_ms", {}).items():
        print(f"    {ms:8.3f} ms  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled", help="bundled, tiny, or a model file or directory (as bundled)")
    ap.add_argument("--running", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=["native-stack"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50, help="timed engine steps per path per round")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantized-activations", default="float32", choices=("float32", "int8", "int16"),
                    help="the bundled model's GGUF blocks' activations")
    ap.add_argument("--sampled", action="store_true", help=f"sample ({SAMPLED}) instead of greedy")
    ap.add_argument("--async-scheduling", action="store_true", help="the engine schedules a step ahead (its "
                    "host work then includes the in-flight bookkeeping; on the CPU nothing overlaps)")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="prefix caching on (the blocks' hashes too) or off (default: the engine's; off for tiny)")
    ap.add_argument("--graphs", action="store_true", help="decode steps through the CUDA-graph path (the flex "
                    "backend), with a stand-in capture whose replays compute nothing: the graph path's host work")
    ap.add_argument("--max-model-len", type=int, default=None, help="the persistent block tables are this long / "
                    "16 columns wide (default: the engine's for the bundled model, what the steps need for tiny)")
    ap.add_argument("--native-calls", action="store_true", help="also the flat loop's native calls replayed alone")
    ap.add_argument("--by-call", action="store_true", help="with --native-calls: the replay's time per kernel and shape")
    ap.add_argument("--top-ops", type=int, default=0, metavar="N", help="the N aten ops of most self time a step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.by_call and not args.native_calls:
        ap.error("--by-call times the calls --native-calls records")
    torch.set_num_threads(args.threads)
    results = {"environment": environment(), "args": vars(args), "batches": []}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load(args, tmp)
        timer = StepTimer(loaded.model)
        recorder = CallRecorder(loaded.model) if args.native_calls else None
        for running in args.running:
            row = profile(args, loaded, timer, recorder, running)
            results["batches"].append(row)
            report(row, args.threads)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
