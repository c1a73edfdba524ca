"""`--profile-decode R`: blockserve decode steps with R running requests (after their prompts are
done): engine step wall time split into scheduler/engine, input preparation, zeroing, forward and
sampling; the forward split per module type (perf_counter hooks); and a torch.profiler pass that
attributes every top-level aten op to a category (matmul, KV cache write, KV gather, gather index
math, SDPA, norms, rope, activation, residual, sampling, ...)."""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict

import torch

from blockserve import LLM, SamplingParams
from blockserve.bench.roofline import ModelShape


class _Regions:
    """Times regions (module forwards, wrapped methods) with perf_counter; optionally also emits
    torch.profiler record_function scopes so aten ops can be attributed to their region."""

    def __init__(self):
        self.inclusive = defaultdict(float)
        self.exclusive = defaultdict(float)
        self.calls = defaultdict(int)
        self.stack: list[list] = []  # [label, start, children seconds, record_function or None]
        self.emit_scopes = False
        self.handles = []
        self.restore = []

    def enter(self, label: str) -> None:
        scope = None
        if self.emit_scopes:
            scope = torch.autograd.profiler.record_function(f"region::{label}")
            scope.__enter__()
        self.stack.append([label, time.perf_counter(), 0.0, scope])

    def exit(self) -> None:
        label, start, children, scope = self.stack.pop()
        if scope is not None:
            scope.__exit__(None, None, None)
        dt = time.perf_counter() - start
        self.inclusive[label] += dt
        self.exclusive[label] += dt - children
        self.calls[label] += 1
        if self.stack:
            self.stack[-1][2] += dt

    def hook_module(self, module: torch.nn.Module, label: str) -> None:
        self.handles.append(module.register_forward_pre_hook(lambda *_: self.enter(label)))
        self.handles.append(module.register_forward_hook(lambda *_: self.exit()))

    def wrap_method(self, obj, attr: str, label: str) -> None:
        """Time `obj.attr` (an instance's method, or a class's: every instance's, `__call__` too)."""
        own = vars(obj).get(attr)  # what `remove` puts back (None: the attribute came from the class)
        original = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            self.enter(label)
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()

        setattr(obj, attr, wrapped)
        self.restore.append((obj, attr, own))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for obj, attr, own in reversed(self.restore):
            if own is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)


_MODULE_LABELS = {  # class name -> region label; the exclusive time of a container is its glue
    "RMSNorm": "norm",
    "Linear": "linear (matmul)",
    "QuantizedLinear": "linear (matmul)",
    "PanelLinear": "linear (matmul)",
    "Embedding": "embedding",
    "RotaryEmbedding": "rope cos/sin lookup",
    "Attention": "paged attention (write+gather+SDPA)",
    "LlamaAttention": "attn glue: split/view/rope",
    "GatedMLP": "mlp glue: silu*up",
    "LlamaDecoderLayer": "layer glue: residual adds",
    "LlamaModel": "model glue",
}


def _instrument(model: torch.nn.Module) -> _Regions:
    """Hooks on the loaded model's modules and attention backends, and on the worker's InputBatch
    and Sampler classes (so no engine is reached into; `remove()` undoes them all)."""
    from blockserve.worker.input_batch import InputBatch
    from blockserve.worker.sampler import Sampler

    regions = _Regions()
    for module in model.modules():
        label = _MODULE_LABELS.get(type(module).__name__)
        if label:
            regions.hook_module(module, label)
    seen = set()
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if backend is not None and id(backend) not in seen:
            seen.add(id(backend))
            regions.wrap_method(backend, "_gather", "attn: gather index math")
            regions.wrap_method(backend, "_attend", "attn: SDPA (incl. transposes)")
    regions.wrap_method(model, "compute_logits", "lm_head (matmul)")
    regions.wrap_method(InputBatch, "prepare", "prepare inputs")
    regions.wrap_method(InputBatch, "update", "update input batch")
    regions.wrap_method(Sampler, "__call__", "sampler")
    return regions


_REGION_CATEGORIES = {  # region label -> category of the aten ops directly inside it
    "paged attention (write+gather+SDPA)": "attention misc (views, arange, empty, copy out)",
    "attn: gather index math": "gather index math",
    "attn: SDPA (incl. transposes)": "SDPA",
    "norm": "norms",
    "attn glue: split/view/rope": "rope + qkv split/views",
    "rope cos/sin lookup": "rope + qkv split/views",
    "mlp glue: silu*up": "activation (silu * up)",
    "layer glue: residual adds": "residual adds",
    "sampler": "sampling",
    "prepare inputs": "input preparation",
    "update input batch": "input preparation",
}


def _categorise(events) -> dict[str, float]:
    """Seconds per category: every aten op whose parent is not an aten op (a top-level op, or one
    directly inside a region scope), attributed by op name and innermost region."""
    totals = defaultdict(float)
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        if parent is not None and not parent.name.startswith("region::"):
            continue
        region = parent.name[len("region::"):] if parent is not None else ""
        name = e.name
        if name in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm"):
            cat = "matmul (linear + lm_head)" if region in ("linear (matmul)", "lm_head (matmul)") else f"matmul in {region or 'step'}"
        elif name == "aten::scaled_dot_product_attention":
            cat = "SDPA"
        elif region == "paged attention (write+gather+SDPA)" and name in ("aten::index_copy_", "aten::index_put_"):
            cat = "KV cache write"
        elif region == "paged attention (write+gather+SDPA)" and name == "aten::index":
            cat = "KV gather (index copy)"
        elif region in _REGION_CATEGORIES:
            cat = _REGION_CATEGORIES[region]
        else:
            cat = f"other ({region or 'outside regions'})"
        totals[cat] += e.cpu_time_total / 1e6
    return dict(totals)


def profile_decode(loaded, engine_args: dict, conv_prompts: list[list[int]], running: int, steps: int,
                   warm_steps: int) -> dict:
    """Profile `steps` blockserve decode steps with `running` requests in steady decode, after
    `warm_steps` decode steps (so the contexts are those of the middle of a generation)."""
    llm = LLM(loaded, **engine_args)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3 * steps + warm_steps + 8, ignore_eos=True)
    prompt_lens = {}
    for i in range(running):
        prompt = conv_prompts[i % len(conv_prompts)]
        engine.add_request(f"profile-{i}", prompt, params)
        prompt_lens[f"profile-{i}"] = len(prompt)
    generated = dict.fromkeys(prompt_lens, 0)

    def step() -> None:
        for output in engine.step():
            generated[output.request_id] = len(output.outputs[0].token_ids)

    for _ in range(1000):  # until every prompt is done (chunked prefill), then two warm decode steps
        step()
        if engine.stats().num_running == running and all(generated.values()):
            break
    for _ in range(max(2, warm_steps)):
        step()
    contexts = [prompt_lens[r] + generated[r] for r in prompt_lens]

    def timed_steps(regions: _Regions | None):
        phases = ("zero", "prepare", "forward", "sample")
        before = [getattr(engine.step_timings(), k) for k in phases]
        walls = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        after = [getattr(engine.step_timings(), k) for k in phases]
        return walls, [(a - b) / steps for a, b in zip(after, before)]

    walls, phases = timed_steps(None)  # plain: no hooks
    wall = statistics.median(walls)
    mean_wall = statistics.fmean(walls)
    phase = dict(zip(("zero", "prepare", "forward", "sample"), phases))
    phase["scheduler+engine (rest)"] = mean_wall - sum(phases)

    regions = _instrument(loaded.model)
    hook_walls, _ = timed_steps(regions)
    hooked = {"exclusive_ms": {k: 1e3 * v / steps for k, v in regions.exclusive.items()},
              "calls_per_step": {k: v // steps for k, v in regions.calls.items()},
              "wall_ms": 1e3 * statistics.fmean(hook_walls)}

    regions.emit_scopes = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        prof_wall = (time.perf_counter() - start) / steps
    regions.remove()
    events = prof.events()
    cats = {k: 1e3 * v / steps for k, v in _categorise(events).items()}
    top_ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()
                      if e.key.startswith("aten::")), key=lambda x: -x[1])[:15]
    del llm
    gc.collect()
    return {
        "running": running, "steps": steps, "context_mean": statistics.fmean(contexts),
        "context_max": max(contexts),
        "step_ms_median": 1e3 * wall, "step_ms_mean": 1e3 * mean_wall,
        "phase_ms": {k: 1e3 * v for k, v in phase.items()},
        "regions": hooked,
        "profiler_step_ms": 1e3 * prof_wall,
        "profiler_categories_ms": cats,
        "profiler_untracked_ms": 1e3 * prof_wall - sum(cats.values()),
        "top_aten_ops_self_ms": [{"op": k, "ms": ms, "calls": c} for k, ms, c in top_ops],
    }


def print_profile(p: dict, shape: ModelShape, gemm_peak: float | None) -> None:
    print(f"\n== blockserve decode step, {p['running']} running requests (context mean {p['context_mean']:.0f}, "
          f"max {p['context_max']}), {p['steps']} steps ==")
    print(f"step wall: median {p['step_ms_median']:.1f} ms, mean {p['step_ms_mean']:.1f} ms "
          f"({p['running'] / p['step_ms_median'] * 1e3:.1f} tok/s)")
    total = p["step_ms_mean"]
    for k, v in p["phase_ms"].items():
        print(f"  {k:<28} {v:8.2f} ms  {100 * v / total:5.1f}%")
    r = p["regions"]
    print(f"forward and runner regions (perf_counter hooks, exclusive; step wall with hooks {r['wall_ms']:.1f} ms):")
    for k, v in sorted(r["exclusive_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<40} {v:8.2f} ms  {100 * v / r['wall_ms']:5.1f}%  ({r['calls_per_step'][k]} calls/step)")
    linear_ms = r["exclusive_ms"].get("linear (matmul)", 0) + r["exclusive_ms"].get("lm_head (matmul)", 0)
    if linear_ms and gemm_peak:
        gflop = 2 * (shape.linear_params + shape.lm_head_params) * p["running"] / 1e9
        print(f"  -> matmuls: {gflop:.2f} GFLOP in {linear_ms:.1f} ms = {gflop / linear_ms * 1e3:.0f} GFLOP/s "
              f"({100 * gflop / linear_ms * 1e3 / gemm_peak:.0f}% of the measured GEMM peak)")
    print(f"aten ops by category (torch.profiler; step wall under the profiler {p['profiler_step_ms']:.1f} ms):")
    for k, v in sorted(p["profiler_categories_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<48} {v:8.2f} ms  {100 * v / p['profiler_step_ms']:5.1f}%")
    u = p["profiler_untracked_ms"]
    print(f"  {'python / dispatch / profiler overhead (rest)':<48} {u:8.2f} ms  {100 * u / p['profiler_step_ms']:5.1f}%")
    plain = p["step_ms_mean"] - sum(p["profiler_categories_ms"].values())
    print(f"  (plain step wall minus the profiled aten op time: {plain:.1f} ms of python/dispatch outside aten ops; "
          f"noisy on a loaded machine)")
    print("top aten ops (self time per step):")
    for op in p["top_aten_ops_self_ms"]:
        print(f"  {op['op']:<48} {op['ms']:8.2f} ms  {op['calls']:6d} calls")
