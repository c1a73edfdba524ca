"""Peer comparison: blockserve `LLM.generate` against transformers and llama.cpp, same run, same machine.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.peers.run [--num-prompts 64] [--max-tokens 128]
        [--rounds 3] [--threads N] [--hf-batch-sizes 16 64] [--skip hf-sequential ...] [--json PATH]
        [--itl-prompts 4] [--attention-backend exact|whole_block] [--no-prefix-caching]
        [--no-progress]

    quick look:  --num-prompts 16 --max-tokens 32 --rounds 1 --threads 1
    llama.cpp needs llama-cpp-python:  pip install '.[peers]'  (or `make bench-peers`)

Workload: SmolLM2-135M-Instruct from the bundled GGUF; the 64 chat
conversations of blockserve/bench/workloads.py rendered with the chat template (about 15-200
prompt tokens); 128 new tokens each, greedy, EOS ignored. `--num-prompts N` takes N of them spread
evenly over the prompt-length distribution; `--max-tokens` shortens generations. Every system gets
the same prompt token ids.

Systems, interleaved round by round (each round runs every system once, in this order), medians
over `--rounds`:

    blockserve            LLM.generate over the whole batch, fp32 (a fresh engine on the same loaded
                          weights each round; prefix caching within a round unless --no-prefix-caching);
                          steps of at most 16 rows read the GGUF's Q4_1/Q8_0 blocks (the same weight
                          values; models/quantized_linear.py)
    blockserve-kv-f16     the same with kv_cache_dtype float16: K/V stored in half the bytes (llama.cpp's
                          default), attention still in float32; its tokens may differ from fp32 ones
    hf-sequential         transformers generate, fp32, one prompt at a time
    hf-batchB             transformers generate, fp32, static batches of B prompts, left padding
    hf-continuous         transformers continuous batching (generate_batch), fp32, SDPA over its paged
                          cache: it runs on CPU in transformers 5.24; its cache is sized like blockserve's
    llama.cpp-batched     llama.cpp (llama-cpp-python), the Q4_1 GGUF as shipped, all prompts as parallel
                          sequences of one context, one llama_decode per step
    llama.cpp-sequential  the same, one prompt at a time

Every system generates exactly max_tokens tokens per prompt (checked, not assumed); tok/s counts
generated tokens over the wall time of the whole batch (prefill included). Greedy tokens are
compared with blockserve's: the fp32 systems should agree; llama.cpp runs 4-bit weights, so its
count of identical generations is printed for the record only. llama.cpp and generate_batch are
optional: when llama-cpp-python is not importable, or a warm-up run fails, the system is skipped
and the reason printed and recorded in the JSON ("skipped"). llama.cpp gets n_threads = the torch
thread count; --max-num-batched-tokens is blockserve's token budget per step, generate_batch's
max_batch_tokens and llama.cpp's n_batch.

Batch-1 inter-token latency (goal: at least 1.5x lower than transformers generate), each round
after the throughput runs, over `--itl-prompts` prompts of the workload, per prompt the decode time
per token after the first: blockserve from its step loop (`blockserve bench latency`'s TPOT), as
loaded (GGUF blocks) and as "blockserve fp32" (float32 weights only, quantized_matmul=False),
transformers generate as (time of max_tokens new tokens - time of 1) / (max_tokens - 1) (whenever
a transformers system runs), llama.cpp from its decode loop, one sequence (whenever a llama.cpp
system runs). Medians over prompts and rounds.

Every run also prints the roofline (blockserve/bench/roofline.py): the fp32 GEMM peak and copy
bandwidth measured on the spot, the workload's FLOPs, the compute-bound tok/s and blockserve's
fraction of it, and the batch-1 fp32 weight-bandwidth bound. The last line gives blockserve's
ratio to the best peer (goal 1.5x) and its fraction of the compute roofline (goal 60%). Where a
decode step's time goes: `python -m benchmarks.step_profile`.

With two threads libgomp's spin-waiting collapses throughput when another process holds a core:
run with OMP_WAIT_POLICY=PASSIVE. Even then every parallel region waits for a descheduled thread
on a loaded machine, so compare `--threads 1`; thread settings, the load average and each run's
process CPU time / wall time (cpu/wall: the cores the run actually got) are recorded with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.peers.blockserve_runner import BlockserveRunner
from benchmarks.peers.hf_runners import HFContinuousBatchingRunner, HFGenerateRunner, load_hf_model
from benchmarks.peers.report import report
from blockserve.bench.common import environment
from blockserve.bench.roofline import ModelShape, roofline, workload_flops
from blockserve.bench.workloads import workload_prompts
from blockserve.config_args import add_config_arguments, namespace_values
from blockserve.engine.config import EngineConfig
from blockserve.models.default_model import default_model_path

LLAMA_CPP = ("llama.cpp-batched", "llama.cpp-sequential")
OPTIONAL = ("hf-continuous", *LLAMA_CPP)  # skipped, with the reason, when they cannot run here


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64, help="conversations of the fixed workload (1-64)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (EOS ignored)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; every system runs once per round (0: no throughput run)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) before anything runs; llama.cpp's n_threads")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[16, 64], help="static batch sizes for transformers")
    ap.add_argument("--skip", nargs="*", default=[], metavar="SYSTEM",
                    help="systems not to run (hf-sequential, hf-batch16, hf-continuous, llama.cpp-batched, ...); "
                         "nothing is estimated in their place")
    ap.add_argument("--itl-prompts", type=int, default=4, help="prompts for the batch-1 inter-token latency (0: none)")
    add_config_arguments(ap, EngineConfig, title="blockserve engine", defaults={"kv_cache_memory": None},
                         only=("enable_prefix_caching", "attention_backend", "max_num_batched_tokens", "kv_cache_memory"),
                         notes={"max_num_batched_tokens": "also generate_batch's max_batch_tokens and llama.cpp's n_batch",
                                "kv_cache_memory": "default: what the workload needs x 1.5"})
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.itl_prompts and args.max_tokens < 2:
        raise SystemExit("the inter-token latency needs --max-tokens 2 or more (or --itl-prompts 0)")
    progress = not args.no_progress

    env = environment()
    print(f"machine: {env['cpu']} ({' '.join(env['cpu_simd_flags'])}), {env['cpus_usable']} usable CPUs; torch {env['torch']} "
          f"(threads {env['torch_num_threads']}), transformers {env['transformers']}, python {env['python']}; "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}; "
          f"load average {' '.join(f'{x:.2f}' for x in env['load_average_start'])}; blockserve {env['blockserve_commit']}")
    if env["OMP_WAIT_POLICY"] is None and env["torch_num_threads"] > 1:
        print("note: OMP_WAIT_POLICY is unset; on a shared machine OMP_WAIT_POLICY=PASSIVE avoids spin-wait collapse")

    from blockserve.attention.paged_attention import BACKENDS
    from blockserve.models.loader import load_model

    t = time.perf_counter()
    loaded = load_model(None, BACKENDS[args.attention_backend])
    print(f"blockserve model loaded in {time.perf_counter() - t:.1f} s ({loaded.source})")
    tokenizer = loaded.tokenizer
    prompts = workload_prompts(tokenizer, args.num_prompts)
    itl_prompts = workload_prompts(tokenizer, args.itl_prompts) if args.itl_prompts else []
    lens = sorted(map(len, prompts))
    shape = ModelShape.of(loaded.model, loaded.hf_config)
    workload = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "prompt_tokens_total": sum(lens),
                "prompt_len_min": lens[0], "prompt_len_median": statistics.median(lens), "prompt_len_max": lens[-1],
                "prompt_len_mean": statistics.fmean(lens), "itl_prompt_lens": [len(p) for p in itl_prompts]}
    print(f"workload: {len(prompts)} chat prompts of {lens[0]}-{lens[-1]} tokens (mean {workload['prompt_len_mean']:.0f}), "
          f"{args.max_tokens} new tokens each, greedy, EOS ignored; {args.rounds} round(s); batch-1 inter-token "
          f"latency over {len(itl_prompts)} prompt(s)")
    print(f"model: {shape.params / 1e6:.1f} M params ({shape.linear_params / 1e6:.1f} M in decoder linears, "
          f"lm_head {shape.lm_head_params / 1e6:.1f} M tied), fp32")

    per_token_kv = 2 * shape.layers * loaded.hf_config.num_key_value_heads * shape.head_dim * 4
    max_model_len = max(512, -(-(lens[-1] + args.max_tokens) // 256) * 256)
    kv_memory = args.kv_cache_memory or (int(1.5 * per_token_kv * sum(l + args.max_tokens + 16 for l in lens))
                                         + per_token_kv * max_model_len + 64 * 2**20)
    engine_args = {**namespace_values(EngineConfig, args), "max_model_len": max_model_len,
                   "max_num_seqs": max(256, len(prompts)), "kv_cache_memory": kv_memory}

    print("measuring roofline (GEMM peak, copy bandwidth) ...")
    roof = roofline(shape, lens, args.max_tokens)
    results: dict = {"environment": env, "workload": workload, "engine_args": engine_args,
                     "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "roofline": roof, "rounds": [], "itl_rounds": []}

    systems = select_systems(args, len(prompts))
    skipped = {s: "--skip" for s in systems if s in args.skip}
    systems = [s for s in systems if s not in skipped]
    if skipped:
        print(f"skipped on request (no figures for them): {', '.join(skipped)}")
    results["skipped"] = skipped
    tokens_by_system: dict[str, list] = {}
    if args.rounds > 0:
        runners, itl_runners = build_runners(systems, loaded, engine_args, args, progress, skipped, env)
        warm_up(runners, prompts, skipped)  # first-call costs (oneDNN kernels, allocator), not timed
        systems = [s for s in systems if s not in skipped]
        if all(s in skipped for s in LLAMA_CPP):
            itl_runners.pop("llama.cpp", None)
        if not itl_prompts:
            itl_runners = {}

        for r in tqdm(range(args.rounds), desc="rounds", unit="round", disable=not progress):
            round_results = {}
            for system in systems:
                res, tokens = runners[system].run(prompts, args.max_tokens)
                expected = len(prompts) * args.max_tokens
                if res.tokens != expected:
                    raise RuntimeError(f"{system} generated {res.tokens} tokens, expected {expected}")
                round_results[system] = res.to_json()
                tqdm.write(f"round {r + 1} {system:<20} {res.tok_s:8.1f} tok/s  {res.seconds:7.1f} s  "
                           f"cpu/wall {res.cpu_seconds / res.seconds:.2f}  load {res.load_average:.2f}")
                if r == 0:
                    tokens_by_system[system] = tokens
                elif system == "blockserve" and tokens != tokens_by_system[system]:
                    raise RuntimeError("blockserve's greedy tokens changed between rounds")
            results["rounds"].append(round_results)
            itl = {s: [runner.itl(p, args.max_tokens) for p in itl_prompts] for s, runner in itl_runners.items()}
            if itl:
                tqdm.write(f"round {r + 1} batch-1 inter-token latency (median over prompts): " + ", ".join(
                    f"{s} {1e3 * statistics.median(v):.1f} ms" for s, v in itl.items()))
            results["itl_rounds"].append(itl)

    if "blockserve" in tokens_by_system:  # blockserve's roofline counts only the work it computed
        cached = results["rounds"][0]["blockserve"]["prefix_cached_per_request"]
        roof["blockserve_computed"] = computed_bound(roof, workload_flops(shape, lens, args.max_tokens, cached))

    env["load_average_end"] = list(os.getloadavg())
    report(results, systems if args.rounds > 0 else [], tokens_by_system)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.json}")


def computed_bound(roof: dict, flops: dict) -> dict:
    """The compute bound of the work one system actually did (prompt tokens from its prefix cache
    excluded), at the roofline's GEMM peak."""
    seconds = flops["total"] / (roof["gemm_peak_gflops"] * 1e9)
    return {"flops": flops, "compute_bound_s": seconds, "compute_bound_tok_s": flops["generated_tokens"] / seconds}


def select_systems(args: argparse.Namespace, num_prompts: int) -> list[str]:
    """The systems in running order, validating --skip against every name this run knows."""
    systems = ["blockserve", "blockserve-kv-f16", "hf-sequential"]
    seen_sizes = set()
    for b in args.hf_batch_sizes:
        effective = min(b, num_prompts)
        if effective in seen_sizes or effective == 1:
            print(f"hf-batch{b}: with {num_prompts} prompts it would be the same run as another peer; not run")
            continue
        seen_sizes.add(effective)
        systems.append(f"hf-batch{b}")
    systems += ["hf-continuous", *LLAMA_CPP]
    known = ["blockserve-kv-f16", "hf-sequential", *(f"hf-batch{b}" for b in args.hf_batch_sizes), "hf-continuous", *LLAMA_CPP]
    for name in args.skip:
        if name == "blockserve":
            raise SystemExit("blockserve is the system under test; it cannot be skipped")
        if name not in known:
            raise SystemExit(f"--skip {name}: unknown system; choose from {known}")
    return systems


def build_runners(systems: list[str], loaded, engine_args: dict, args: argparse.Namespace,
                  progress: bool, skipped: dict, env: dict) -> tuple[dict, dict]:
    """(a runner per system, the batch-1 latency runners: blockserve as loaded and on fp32 weights
    only, and transformers generate and llama.cpp whenever one of their systems runs); llama.cpp
    systems that cannot load go to `skipped` with the reason."""
    runners = {"blockserve": BlockserveRunner(loaded, engine_args, progress)}
    itl_runners = dict(runners)
    if "blockserve-kv-f16" in systems:  # the same engine with K/V stored as float16 (as llama.cpp does)
        runners["blockserve-kv-f16"] = BlockserveRunner(loaded, {**engine_args, "kv_cache_dtype": "float16"}, progress)
    if args.itl_prompts:  # the batch-1 latency on float32 weights only too, like for like with transformers
        from blockserve.attention.paged_attention import BACKENDS
        from blockserve.models.loader import load_model

        fp32 = load_model(None, BACKENDS[args.attention_backend], quantized_matmul=False)
        itl_runners["blockserve fp32"] = BlockserveRunner(fp32, engine_args, progress)
    if any(s.startswith("hf-") for s in systems):
        t = time.perf_counter()
        model = load_hf_model()
        print(f"transformers model loaded in {time.perf_counter() - t:.1f} s")
        tokenizer = loaded.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        for s in systems:
            if s == "hf-sequential":
                runners[s] = HFGenerateRunner(model, pad, 1, s, progress)
            elif s.startswith("hf-batch"):
                runners[s] = HFGenerateRunner(model, pad, int(s.removeprefix("hf-batch")), s, progress)
        if "hf-continuous" in systems:
            runners["hf-continuous"] = HFContinuousBatchingRunner(model, args.max_num_batched_tokens, progress)
        itl_runners["transformers generate"] = HFGenerateRunner(model, pad, 1, "itl", progress)
    wanted = [s for s in LLAMA_CPP if s in systems]
    if wanted:
        try:
            from benchmarks.peers.llama_cpp_runner import LlamaCppModel, LlamaCppRunner

            t = time.perf_counter()
            model = LlamaCppModel(default_model_path(), torch.get_num_threads(), args.max_num_batched_tokens)
            env["llama_cpp_python"] = model.version
            print(f"llama.cpp (llama-cpp-python {model.version}) loaded the GGUF in {time.perf_counter() - t:.1f} s, "
                  f"n_threads {model.threads}")
            for s in wanted:
                runners[s] = LlamaCppRunner(model, sequential=s == "llama.cpp-sequential")
            itl_runners["llama.cpp"] = LlamaCppRunner(model, sequential=True)
        except (ImportError, OSError, RuntimeError) as e:
            reason = f"llama.cpp unavailable ({type(e).__name__}: {e}); llama-cpp-python installs with pip install '.[peers]'"
            print(f"skipping {', '.join(wanted)}: {reason}")
            skipped.update(dict.fromkeys(wanted, reason))
    return runners, itl_runners


def warm_up(runners: dict, prompts: list[list[int]], skipped: dict) -> None:
    """Run every system once on two prompts; an optional peer that fails goes to `skipped`."""
    for name, runner in runners.items():
        try:
            runner.run(prompts[:2], 4)
        except Exception as e:
            if name not in OPTIONAL:
                raise
            reason = f"{type(e).__name__}: {e}"
            print(f"skipping {name}, its warm-up run failed: {reason}")
            skipped[name] = reason


if __name__ == "__main__":
    sys.exit(main())
