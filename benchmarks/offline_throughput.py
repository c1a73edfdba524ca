"""Offline throughput: blockserve `LLM.generate` against transformers `generate`, same run, same machine.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/offline_throughput.py [--num-prompts 64] [--max-tokens 128]
        [--rounds 3] [--threads N] [--hf-batch-sizes 16 64] [--skip hf-sequential ...] [--json PATH]
        [--attention-backend exact|whole_block] [--no-prefix-caching] [--profile-decode 16 64] [--no-progress]

    quick look:  --num-prompts 16 --max-tokens 32 --rounds 1
    step profile only:  --profile-decode 16 64 --rounds 0

Workload (issue 4 / issue 8): SmolLM2-135M-Instruct from the bundled GGUF, fp32; the 64 chat
conversations below (some with a system prompt, the others get the template's default one),
rendered with the chat template (about 15-200 prompt tokens); 128 new tokens each, greedy, EOS
ignored. `--num-prompts N` takes N of them spread evenly over the prompt-length distribution
(so a quick run keeps the mix of short and long prompts); `--max-tokens` shortens generations.
The workload and the roofline code live in blockserve/benchmark/ (workloads.py, roofline.py),
shared with `blockserve bench`.

Systems, interleaved round by round (each round runs every system once, in this order), medians
over `--rounds`:

    blockserve      LLM.generate over the whole batch (a fresh engine on the same loaded weights
                    each round, so no round reuses the previous round's prefix cache; prefix
                    caching within a round is on unless --no-prefix-caching)
    hf-sequential   transformers generate, one prompt at a time
    hf-batchB       transformers generate, static batches of B prompts, left padding + attention mask

transformers runs greedy with eos_token_id=None and min_new_tokens = max_new_tokens, so every
system generates exactly num_prompts x max_tokens tokens (checked, not assumed). tok/s counts
generated tokens over the wall time of the whole batch (prefill included). blockserve's greedy
tokens are compared with hf-sequential's (same prompt token ids, same fp32 weights): the count of
identical generations is printed, so the comparison is known to be like for like.

Every run also prints the roofline: the fp32 GEMM peak and the copy bandwidth measured on the
spot, the workload's FLOPs (2 x linear params per computed token, the tied lm_head only where a
token is sampled, plus attention 4 x layers x q_heads x head_dim x context), the compute-bound
tok/s and blockserve's fraction of it; and the batch-1 weight-bandwidth bound (fp32 weight bytes
read per token / copy bandwidth).

`--profile-decode R ...` profiles blockserve decode steps with R running requests (after their
prompts are done): engine step wall time split into scheduler/engine, input preparation,
zeroing, forward and sampling; the forward split per module type (perf_counter hooks); and a
torch.profiler pass that attributes every top-level aten op to a category (matmul, KV cache
write, KV gather, gather index math, SDPA, norms, rope, activation, residual, sampling, ...).

With two threads libgomp's spin-waiting collapses throughput when another process holds a core:
run with OMP_WAIT_POLICY=PASSIVE. Even then every parallel region waits for a descheduled thread
on a loaded machine, so compare `--threads 1`; thread settings, the load average and each run's
process CPU time / wall time (cpu/wall: the cores the run actually got) are recorded with every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from blockserve import LLM, SamplingParams
from blockserve.benchmark.common import environment
from blockserve.benchmark.roofline import ModelShape, roofline
from blockserve.benchmark.workloads import workload_prompts
from blockserve.models.default_model import default_model_path


# --------------------------------------------------------------------------------------------
# Systems
# --------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    seconds: float
    tokens: int
    requests: int
    cpu_seconds: float  # process CPU time (all threads) over the run
    load_average: float  # 1-minute load average at the start of the run
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "tokens": self.tokens, "requests": self.requests, "tok_s": self.tok_s,
                "req_s": self.requests / self.seconds, "cpu_per_wall": self.cpu_seconds / self.seconds,
                "load_average_1m": self.load_average, **self.extra}


def _timed(fn):
    load = os.getloadavg()[0]
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    value = fn()
    t1, c1 = time.perf_counter(), time.process_time()
    return value, t1 - t0, c1 - c0, load


class BlockserveRunner:
    def __init__(self, loaded, engine_args: dict, progress: bool):
        self.loaded, self.engine_args, self.progress = loaded, engine_args, progress

    def new_llm(self) -> LLM:
        return LLM(self.loaded, **self.engine_args)

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[RunResult, list[list[int]]]:
        llm = self.new_llm()  # fresh engine (KV cache, prefix cache) on the same weights each round
        timings = llm.engine.core.runner.timings
        before = {k: getattr(timings, k) for k in ("zero", "prepare", "forward", "sample", "steps")}
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs, seconds, cpu, load = _timed(lambda: llm.generate(prompts, params, use_tqdm=self.progress))
        phases = {k: getattr(timings, k) - before[k] for k in before}
        steps = phases.pop("steps")
        phases["scheduler+engine (rest)"] = seconds - sum(phases.values())
        tokens = [o.outputs[0].token_ids for o in outputs]
        extra = {
            "steps": steps,
            "ms_per_step": 1e3 * seconds / max(steps, 1),
            "phase_seconds": phases,
            "phase_share": {k: v / seconds for k, v in phases.items()},
            "prefix_cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        }
        del llm
        gc.collect()
        return RunResult(seconds, sum(map(len, tokens)), len(prompts), cpu, load, extra), tokens


class HFRunner:
    """transformers generate on the same GGUF (dequantised to fp32 by transformers itself)."""

    def __init__(self, pad_token_id: int, progress: bool):
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        self.pad = pad_token_id
        self.progress = progress

    @torch.inference_mode()
    def _generate(self, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=self.pad, temperature=None, top_p=None, top_k=None)
        new = out[:, width:].tolist()
        if any(len(t) != max_tokens for t in new):
            raise RuntimeError(f"transformers generated {[len(t) for t in new]} tokens, expected {max_tokens} each")
        return new

    def run(self, prompts: list[list[int]], max_tokens: int, batch_size: int, name: str) -> tuple[RunResult, list]:
        batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]

        def go():
            tokens = []
            for batch in tqdm(batches, desc=name, unit="batch" if batch_size > 1 else "req",
                              disable=not self.progress or len(batches) < 2, leave=False):
                tokens += self._generate(batch, max_tokens)
            return tokens

        tokens, seconds, cpu, load = _timed(go)
        return RunResult(seconds, sum(map(len, tokens)), len(prompts), cpu, load,
                         {"batch_size": batch_size, "num_batches": len(batches)}), tokens


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    identical = sum(a == b for a, b in zip(ours, theirs))
    first_diff = {}
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            first_diff[i] = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"identical": identical, "total": len(ours), "first_difference_at": first_diff}


# --------------------------------------------------------------------------------------------
# Decode-step profile
# --------------------------------------------------------------------------------------------


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
        original = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            self.enter(label)
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()

        setattr(obj, attr, wrapped)
        self.restore.append((obj, attr))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for obj, attr in self.restore:
            delattr(obj, attr)


class _CallWrapper:
    def __init__(self, regions: _Regions, target, label: str):
        self.regions, self.target, self.label = regions, target, label

    def __call__(self, *args, **kwargs):
        self.regions.enter(self.label)
        try:
            return self.target(*args, **kwargs)
        finally:
            self.regions.exit()


_MODULE_LABELS = {  # class name -> region label; the exclusive time of a container is its glue
    "RMSNorm": "norm",
    "Linear": "linear (matmul)",
    "Embedding": "embedding",
    "RotaryEmbedding": "rope cos/sin lookup",
    "Attention": "paged attention (write+gather+SDPA)",
    "LlamaAttention": "attn glue: split/view/rope",
    "LlamaMLP": "mlp glue: silu*up",
    "LlamaDecoderLayer": "layer glue: residual adds",
    "LlamaModel": "model glue",
}


def _instrument(llm: LLM) -> _Regions:
    regions = _Regions()
    runner = llm.engine.core.runner
    model = runner.model
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
    regions.wrap_method(runner.batch, "prepare", "prepare inputs")
    regions.wrap_method(runner.batch, "update", "update input batch")
    runner.sampler = _CallWrapper(regions, runner.sampler, "sampler")
    return regions


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
        elif region == "paged attention (write+gather+SDPA)" and name == "aten::index_put_":
            cat = "KV cache write (index_put_)"
        elif region == "paged attention (write+gather+SDPA)" and name == "aten::index":
            cat = "KV gather (index copy)"
        elif region == "paged attention (write+gather+SDPA)":
            cat = "attention misc (views, arange, empty, copy out)"
        elif region == "attn: gather index math":
            cat = "gather index math"
        elif region == "attn: SDPA (incl. transposes)":
            cat = "SDPA"
        elif region == "norm":
            cat = "norms"
        elif region in ("attn glue: split/view/rope", "rope cos/sin lookup"):
            cat = "rope + qkv split/views"
        elif region == "mlp glue: silu*up":
            cat = "activation (silu * up)"
        elif region == "layer glue: residual adds":
            cat = "residual adds"
        elif region == "sampler":
            cat = "sampling"
        elif region in ("prepare inputs", "update input batch"):
            cat = "input preparation"
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
    for i in range(running):
        engine.add_request(f"profile-{i}", conv_prompts[i % len(conv_prompts)], params)
    runner = engine.core.runner
    for _ in range(1000):  # until every prompt is done (chunked prefill), then two warm decode steps
        engine.step()
        reqs = runner.batch.requests
        if len(reqs) == running and all(r.output_token_ids for r in reqs.values()):
            break
    for _ in range(max(2, warm_steps)):
        engine.step()
    contexts = [r.num_tokens for r in runner.batch.requests.values()]

    def timed_steps(regions: _Regions | None):
        t = runner.timings
        before = (t.zero, t.prepare, t.forward, t.sample)
        walls = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        after = (t.zero, t.prepare, t.forward, t.sample)
        return walls, [(a - b) / steps for a, b in zip(after, before)]

    walls, phases = timed_steps(None)  # plain: no hooks
    wall = statistics.median(walls)
    mean_wall = statistics.fmean(walls)
    phase = dict(zip(("zero", "prepare", "forward", "sample"), phases))
    phase["scheduler+engine (rest)"] = mean_wall - sum(phases)

    regions = _instrument(llm)
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


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64, help="conversations of the fixed workload (1-64)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (EOS ignored)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; every system runs once per round (0: no throughput run)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) before anything runs")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[16, 64], help="static batch sizes for transformers")
    ap.add_argument("--skip", nargs="*", default=[], metavar="SYSTEM",
                    help="systems not to run (hf-sequential, hf-batch16, ...); nothing is estimated in their place")
    ap.add_argument("--no-prefix-caching", action="store_true", help="blockserve without prefix caching")
    ap.add_argument("--attention-backend", default="exact", help="blockserve attention backend (exact, whole_block)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="blockserve's token budget per step")
    ap.add_argument("--kv-cache-memory", default=None, help="blockserve KV cache budget (default: what the workload needs x 1.5)")
    ap.add_argument("--profile-decode", type=int, nargs="*", default=[], metavar="RUNNING",
                    help="profile blockserve decode steps with this many running requests")
    ap.add_argument("--profile-steps", type=int, default=5, help="decode steps per profile")
    ap.add_argument("--profile-warm-steps", type=int, default=None,
                    help="decode steps before profiling (default: max_tokens / 2, mid-generation contexts)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress

    env = environment()
    print(f"machine: {env['cpu']}, {env['cpus_usable']} usable CPUs; torch {env['torch']} "
          f"(threads {env['torch_num_threads']}), transformers {env['transformers']}, python {env['python']}; "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}; "
          f"load average {' '.join(f'{x:.2f}' for x in env['load_average_start'])}; blockserve {env['blockserve_commit']}")
    if env["OMP_WAIT_POLICY"] is None and env["torch_num_threads"] > 1:
        print("note: OMP_WAIT_POLICY is unset; on a shared machine OMP_WAIT_POLICY=PASSIVE avoids spin-wait collapse")

    from blockserve.attention.paged_attention import BACKENDS
    from blockserve.models.loader import load_model

    t = time.perf_counter()
    if args.attention_backend not in BACKENDS:
        raise SystemExit(f"--attention-backend must be one of {sorted(BACKENDS)}")
    loaded = load_model(None, BACKENDS[args.attention_backend])
    print(f"blockserve model loaded in {time.perf_counter() - t:.1f} s ({loaded.source})")
    tokenizer = loaded.tokenizer
    prompts = workload_prompts(tokenizer, args.num_prompts)
    lens = sorted(map(len, prompts))
    shape = ModelShape.of(loaded.model, loaded.hf_config)
    workload = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "prompt_tokens_total": sum(lens),
                "prompt_len_min": lens[0], "prompt_len_median": statistics.median(lens), "prompt_len_max": lens[-1],
                "prompt_len_mean": statistics.fmean(lens)}
    print(f"workload: {len(prompts)} chat prompts of {lens[0]}-{lens[-1]} tokens (mean {workload['prompt_len_mean']:.0f}), "
          f"{args.max_tokens} new tokens each, greedy, EOS ignored; {args.rounds} round(s)")
    print(f"model: {shape.params / 1e6:.1f} M params ({shape.linear_params / 1e6:.1f} M in decoder linears, "
          f"lm_head {shape.lm_head_params / 1e6:.1f} M tied), fp32")

    per_token_kv = 2 * shape.layers * loaded.hf_config.num_key_value_heads * shape.head_dim * 4
    max_model_len = max(512, -(-(lens[-1] + args.max_tokens) // 256) * 256)
    scale = max([1.0] + [r / len(prompts) for r in args.profile_decode])  # profiles may run more requests
    kv_memory = args.kv_cache_memory or (int(1.5 * scale * per_token_kv * sum(l + args.max_tokens + 16 for l in lens))
                                         + per_token_kv * max_model_len + 64 * 2**20)
    engine_args = {"max_model_len": max_model_len, "enable_prefix_caching": not args.no_prefix_caching,
                   "attention_backend": args.attention_backend,
                   "max_num_seqs": max(256, len(prompts)),
                   "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory": kv_memory}

    print("measuring roofline (GEMM peak, copy bandwidth) ...")
    roof = roofline(shape, lens, args.max_tokens)
    results: dict = {"environment": env, "workload": workload, "engine_args": engine_args,
                     "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "roofline": roof, "rounds": [], "profiles": []}

    systems = ["blockserve", "hf-sequential"]
    seen_sizes = set()
    for b in args.hf_batch_sizes:
        effective = min(b, len(prompts))
        if effective in seen_sizes or effective == 1:
            print(f"hf-batch{b}: with {len(prompts)} prompts it would be the same run as another peer; not run")
            continue
        seen_sizes.add(effective)
        systems.append(f"hf-batch{b}")
    known = ["hf-sequential"] + [f"hf-batch{b}" for b in args.hf_batch_sizes]
    for name in args.skip:
        if name == "blockserve":
            raise SystemExit("blockserve is the system under test; it cannot be skipped")
        if name not in known:
            raise SystemExit(f"--skip {name}: unknown system; choose from {known}")
    skipped = [s for s in systems if s in args.skip]
    systems = [s for s in systems if s not in args.skip]
    if skipped:
        print(f"skipped on request (no figures for them): {', '.join(skipped)}")
    results["skipped"] = skipped
    tokens_by_system: dict[str, list] = {}
    if args.rounds > 0:
        bs = BlockserveRunner(loaded, engine_args, progress)
        hf = None
        if any(s.startswith("hf-") for s in systems):
            t = time.perf_counter()
            hf = HFRunner(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                          progress)
            print(f"transformers model loaded in {time.perf_counter() - t:.1f} s")
        # warm-up (first-call costs: oneDNN kernels, allocator), not timed
        bs.run(prompts[:2], 4)
        if hf is not None:
            hf.run(prompts[:2], 4, 1, "warm-up")
            hf.run(prompts[:2], 4, 2, "warm-up")

        for r in tqdm(range(args.rounds), desc="rounds", unit="round", disable=not progress):
            round_results = {}
            for system in systems:
                if system == "blockserve":
                    res, tokens = bs.run(prompts, args.max_tokens)
                elif system == "hf-sequential":
                    res, tokens = hf.run(prompts, args.max_tokens, 1, system)
                else:
                    res, tokens = hf.run(prompts, args.max_tokens, int(system.removeprefix("hf-batch")), system)
                expected = len(prompts) * args.max_tokens
                if res.tokens != expected:
                    raise RuntimeError(f"{system} generated {res.tokens} tokens, expected {expected}")
                round_results[system] = res.to_json()
                tqdm.write(f"round {r + 1} {system:<14} {res.tok_s:8.1f} tok/s  {res.seconds:7.1f} s  "
                           f"cpu/wall {res.cpu_seconds / res.seconds:.2f}  load {res.load_average:.2f}")
                if r == 0:
                    tokens_by_system[system] = tokens
                elif system == "blockserve" and tokens != tokens_by_system[system]:
                    raise RuntimeError("blockserve's greedy tokens changed between rounds")
            results["rounds"].append(round_results)

    for running in args.profile_decode:
        print(f"profiling {running} running requests ...")
        warm = args.max_tokens // 2 if args.profile_warm_steps is None else args.profile_warm_steps
        results["profiles"].append(profile_decode(loaded, engine_args, prompts, running, args.profile_steps, warm))

    env["load_average_end"] = list(os.getloadavg())
    report(results, systems if args.rounds > 0 else [], tokens_by_system, shape)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.json}")


def report(results: dict, systems: list[str], tokens_by_system: dict, shape: ModelShape) -> None:
    roof, workload, env = results["roofline"], results["workload"], results["environment"]
    medians = {}
    if systems:
        for s in systems:
            runs = [rnd[s] for rnd in results["rounds"]]
            medians[s] = {k: statistics.median(run[k] for run in runs) for k in ("tok_s", "req_s", "seconds", "cpu_per_wall")}
            medians[s]["tok_s_all_rounds"] = [run["tok_s"] for run in runs]
        ours = medians["blockserve"]["tok_s"]
        for s in systems:
            medians[s]["blockserve_ratio"] = ours / medians[s]["tok_s"]
        results["medians"] = medians
        parity = {}
        for s in systems:
            if s != "blockserve":
                parity[s] = compare_tokens(tokens_by_system["blockserve"], tokens_by_system[s])
        results["parity_vs_blockserve"] = parity

        n = len(results["rounds"])
        print(f"\n== offline throughput: {workload['num_prompts']} prompts x {workload['max_tokens']} new tokens, "
              f"median of {n} round(s) ==")
        print(f"{'system':<15} {'tok/s':>9} {'req/s':>7} {'seconds':>9} {'cpu/wall':>9} {'blockserve x':>13}   rounds (tok/s)")
        for s in systems:
            m = medians[s]
            rounds = " ".join(f"{x:.1f}" for x in m["tok_s_all_rounds"])
            print(f"{s:<15} {m['tok_s']:9.1f} {m['req_s']:7.3f} {m['seconds']:9.1f} {m['cpu_per_wall']:9.2f} "
                  f"{m['blockserve_ratio']:12.2f}x   {rounds}")
        for s, p in parity.items():
            note = "" if p["identical"] == p["total"] else \
                f" (first differences at token {sorted(p['first_difference_at'].values())})"
            print(f"greedy tokens identical to blockserve: {s} {p['identical']}/{p['total']}{note}")

        bs_runs = [rnd["blockserve"] for rnd in results["rounds"]]
        mid = sorted(bs_runs, key=lambda run: run["tok_s"])[len(bs_runs) // 2]
        print(f"blockserve (median round): {mid['seconds']:.1f} s, {mid['tok_s']:.1f} tok/s, {mid['req_s']:.3f} req/s, "
              f"{mid['steps']} steps ({mid['ms_per_step']:.1f} ms/step), "
              f"{mid['prefix_cached_prompt_tokens']} of {workload['prompt_tokens_total']} prompt tokens from the prefix cache")
        print("blockserve step profile (share of total time): " + ", ".join(
            f"{k} {100 * v:.1f}%" for k, v in mid["phase_share"].items()))

    f = roof["flops"]
    print(f"\n== roofline (fp32, {env['torch_num_threads']} threads) ==")
    shaped = ", ".join(f"{k} {v:.0f}" for k, v in roof["linear_gflops_model_shapes"].items())
    print(f"GEMM peak {roof['gemm_peak_gflops']:.0f} GFLOP/s (best of: 2048^3 matmul {roof['gemm_2048_gflops']:.0f}; "
          f"model-shaped linears [MxKxN] {shaped})")
    print(f"memory bandwidth: copy {roof['copy_bandwidth_gbs']:.1f} GB/s (read + write, 512 MiB tensor); "
          f"read-only {roof['read_bandwidth_gbs']:.1f} GB/s (sum)")
    print(f"workload: {f['total'] / 1e12:.3f} TFLOP = linear {f['linear'] / 1e12:.3f} + lm_head {f['lm_head'] / 1e12:.3f} "
          f"+ attention {f['attention'] / 1e12:.3f} (avg context {f['avg_context']:.0f}); "
          f"{f['per_generated_token'] / 1e6:.0f} MFLOP per generated token, prefill included "
          f"(per computed token, 2 x params + attention: {f['rule_of_thumb_per_token'] / 1e6:.0f})")
    print(f"compute bound: {roof['compute_bound_tok_s']:.0f} tok/s ({roof['compute_bound_s']:.1f} s for the workload)")
    print(f"batch-1 weight-bandwidth bound: {roof['weight_bytes_per_token'] / 1e6:.0f} MB of fp32 weights per token -> "
          f"{roof['batch1_bandwidth_bound_ms_per_token']:.1f} ms/token, {roof['batch1_bandwidth_bound_tok_s']:.1f} tok/s "
          f"at the copy bandwidth ({roof['batch1_read_bandwidth_bound_ms_per_token']:.1f} ms/token at the read-only one)")
    if medians:
        frac = medians["blockserve"]["tok_s"] / roof["compute_bound_tok_s"]
        results["blockserve_fraction_of_compute_roofline"] = frac
        print(f"blockserve: {100 * frac:.1f}% of the compute roofline (goal: 60%)")
        if "hf-sequential" in medians:
            print(f"hf-sequential (batch 1): {100 * medians['hf-sequential']['tok_s'] / roof['batch1_bandwidth_bound_tok_s']:.0f}% "
                  f"of the batch-1 bandwidth bound (blockserve's batch-1 latency: `blockserve bench latency`)")
    for p in results["profiles"]:
        print_profile(p, shape, roof["gemm_peak_gflops"])


if __name__ == "__main__":
    sys.exit(main())
