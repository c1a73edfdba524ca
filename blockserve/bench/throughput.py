"""`blockserve bench throughput`: offline throughput of the engine over a whole batch.

    blockserve bench throughput                                   (the fixed 64-prompt chat workload, 128 new tokens)
    blockserve bench throughput --num-prompts 16 --max-tokens 32   (16 of the chat prompts, spread over their lengths)
    blockserve bench throughput --random-input-len 256 --random-output-len 64 --num-prompts 100
    OMP_WAIT_POLICY=PASSIVE blockserve bench throughput --num-threads 1 --output-json throughput.json

Every request is queued at once and generated greedily with EOS ignored, so each generates
exactly --max-tokens tokens (checked). Rates count wall time over the whole batch, prefill
included: generated tokens/s, prompt + generated tokens/s, requests/s. Each round runs on a fresh
engine (fresh KV and prefix cache) over the weights loaded once; medians over --rounds. With
--kv-cache-memory unset the cache holds every request at once (x1.5). Unless --no-roofline,
the fp32 roofline is measured on the spot (a few seconds) and the run's fraction of it printed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from blockserve.bench.common import (add_engine_args, add_workload_args, args_record, bench_prompts,
                                         engine_config_for, engine_record, environment, load_for_bench, new_engine,
                                         print_environment, thread_settings, write_json)


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput (generated tokens/s, requests/s)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--rounds", type=int, default=1, help="timed runs, each on a fresh engine; medians reported")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    p.add_argument("--no-roofline", action="store_true", help="do not measure the fp32 roofline")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--output-json", default=None, help="write the results here")
    add_engine_args(p)
    p.set_defaults(func=run)


def run_batch(engine, prompts: list[list[int]], params, tag: str, progress: bool) -> dict:
    """Queue every prompt, step until all finish; one round's figures."""
    from tqdm import tqdm

    phases = ("zero", "prepare", "forward", "sample")
    timings = engine.step_timings()
    before = {k: getattr(timings, k) for k in (*phases, "steps")}
    preempt_before = engine.stats().num_preemptions
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished = {}
    with tqdm(total=len(ids), desc=tag, unit="req", disable=not progress, leave=False) as bar:
        while len(finished) < len(ids):
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    while engine.has_unfinished_requests():  # hand the last finished ids to the worker (untimed)
        engine.step()
    outputs = [finished[i] for i in ids]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    timings = engine.step_timings()
    spent = {k: getattr(timings, k) - before[k] for k in phases}
    steps = timings.steps - before["steps"]
    spent["scheduler+engine (rest)"] = seconds - sum(spent.values())
    return {
        "seconds": seconds, "requests": len(prompts), "prompt_tokens": prompt_tokens, "generated_tokens": generated,
        "generated_tokens_per_s": generated / seconds, "total_tokens_per_s": (prompt_tokens + generated) / seconds,
        "requests_per_s": len(prompts) / seconds, "cpu_per_wall": cpu / seconds, "steps": steps,
        "ms_per_step": 1e3 * seconds / max(steps, 1), "phase_share": {k: v / seconds for k, v in spent.items()},
        "prefix_cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        "prefix_cached_per_request": [o.num_cached_tokens for o in outputs],  # in prompt order
        "preemptions": engine.stats().num_preemptions - preempt_before,
    }


def run(args: argparse.Namespace) -> int:
    from blockserve.sampling_params import SamplingParams

    if args.rounds < 1 or args.max_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--rounds, --max-tokens and --num-prompts must be positive")
    progress = not args.no_progress
    flags_config, loaded = load_for_bench(args)
    prompts, kind = bench_prompts(args, loaded, args.num_prompts)
    lens = sorted(map(len, prompts))
    config = engine_config_for(flags_config, loaded, [n + args.max_tokens for n in lens], args.kv_cache_memory is None)
    env = environment()
    print_environment(env)
    workload = {"kind": kind, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
                "prompt_tokens_total": sum(lens), "prompt_len_min": lens[0], "prompt_len_median": statistics.median(lens),
                "prompt_len_max": lens[-1], "prompt_len_mean": statistics.fmean(lens)}
    print(f"model: {loaded.source}; workload: {kind}, {len(prompts)} prompts of {lens[0]}-{lens[-1]} tokens "
          f"(mean {workload['prompt_len_mean']:.0f}), {args.max_tokens} new tokens each, greedy, EOS ignored; "
          f"{args.rounds} round(s)")

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if not args.no_warmup:  # first-call costs (oneDNN kernels, allocator), untimed
        run_batch(new_engine(config, loaded), prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                  "warm-up", False)
    rounds = []
    for r in range(args.rounds):
        engine = new_engine(config, loaded)  # fresh KV and prefix cache every round
        res = run_batch(engine, prompts, params, f"round-{r + 1}", progress)
        del engine
        expected = len(prompts) * args.max_tokens
        if res["generated_tokens"] != expected:
            raise RuntimeError(f"generated {res['generated_tokens']} tokens, expected {expected}")
        rounds.append(res)
        print(f"round {r + 1}: {res['generated_tokens_per_s']:.1f} generated tok/s, {res['requests_per_s']:.3f} req/s, "
              f"{res['seconds']:.2f} s, {res['steps']} steps, cpu/wall {res['cpu_per_wall']:.2f}, "
              f"{res['preemptions']} preemptions")

    keys = ("seconds", "generated_tokens_per_s", "total_tokens_per_s", "requests_per_s")
    medians = {k: statistics.median(r[k] for r in rounds) for k in keys}
    threads = thread_settings()
    results = {
        "benchmark": "throughput", "thread_settings": threads, "environment": env, "args": args_record(args),
        "engine": engine_record(config), "workload": workload, "rounds": rounds, **medians,
        "num_requests": len(prompts), "generated_tokens": rounds[0]["generated_tokens"],
        "expected_generated_tokens": len(prompts) * args.max_tokens, "prompt_tokens": workload["prompt_tokens_total"],
        "roofline": None, "fraction_of_compute_roofline": None,
    }
    print(f"\n== bench throughput: {len(prompts)} requests x {args.max_tokens} new tokens, median of "
          f"{len(rounds)} round(s) ==")
    print(f"generated tokens/s {medians['generated_tokens_per_s']:.1f}   total tokens/s "
          f"{medians['total_tokens_per_s']:.1f}   requests/s {medians['requests_per_s']:.3f}   "
          f"seconds {medians['seconds']:.2f}")
    print("step time: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in rounds[len(rounds) // 2]["phase_share"].items()))
    print(f"threads: torch {threads['torch_num_threads']}, OMP_NUM_THREADS={threads['OMP_NUM_THREADS']}, "
          f"OMP_WAIT_POLICY={threads['OMP_WAIT_POLICY']}")
    if not args.no_roofline:
        # The work actually done: prompt tokens served from the prefix cache were not computed.
        results["roofline"], results["fraction_of_compute_roofline"] = _roofline(
            loaded, [len(p) for p in prompts], args.max_tokens, medians["generated_tokens_per_s"],
            rounds[0]["prefix_cached_per_request"])
    env["load_average_end"] = list(os.getloadavg())
    write_json(args.output_json, results)
    return 0


def _roofline(loaded, prompt_lens: list[int], max_tokens: int, tok_s: float,
              cached_prompt_tokens: list[int]) -> tuple[dict | None, float | None]:
    from blockserve.bench.roofline import ModelShape, report_lines, roofline

    try:
        shape = ModelShape.of(loaded.model, loaded.hf_config)
    except AttributeError as e:  # a model whose config lacks a dense-model field
        print(f"roofline: not available for this model ({e})")
        return None, None
    print("\n== roofline (fp32; measured now) ==")
    roof = roofline(shape, prompt_lens, max_tokens, cached_prompt_tokens)
    print(f"counting computed work only: {sum(cached_prompt_tokens)} prompt tokens came from the prefix cache")
    for line in report_lines(roof, tok_s):
        print(line)
    return roof, tok_s / roof["compute_bound_tok_s"]
