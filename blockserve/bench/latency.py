"""`blockserve bench latency`: time to first token, inter-token latency and end-to-end latency
at fixed batch sizes, offline.

    blockserve bench latency --batch-sizes 1 4 16                   (chat prompts, 128 new tokens)
    OMP_WAIT_POLICY=PASSIVE blockserve bench latency --batch-sizes 1 --num-threads 1 --max-tokens 64
    blockserve bench latency --random-input-len 128 --max-tokens 32 --batch-sizes 1 8 --output-json lat.json

For each batch size B: --num-warmup-iters untimed and --num-iters timed iterations, each queueing
B requests at once (the first B prompts of the chat workload spread over its lengths, or random
ones) and stepping the engine until all finish, greedy with EOS ignored. Every engine step's
outputs are timestamped: TTFT is first token - queueing, inter-token latency (ITL) the gap
between a request's consecutive tokens, E2E last token - queueing, TPOT (E2E - TTFT) / (tokens - 1)
per request. Medians, means, p90 and p99 over all requests (and gaps) of the timed iterations, in
ms. Each iteration uses its own cache salt, so no iteration reuses another's prefix cache.
Unless --no-roofline, the batch-1 fp32 weight-bandwidth bound is measured and compared with the
batch-1 ITL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from blockserve.bench.common import (add_engine_args, add_workload_args, args_record, bench_prompts,
                                         engine_config_for, engine_record, environment, format_summary, load_for_bench,
                                         new_engine, print_environment, summarize, thread_settings, write_json)


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="TTFT, inter-token and end-to-end latency at batch sizes 1..N",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, default_num_prompts=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="requests queued at once")
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations per batch size")
    p.add_argument("--num-warmup-iters", type=int, default=1, help="untimed iterations per batch size")
    p.add_argument("--no-roofline", action="store_true", help="do not measure the batch-1 bandwidth bound")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--output-json", default=None, help="write the results here")
    add_engine_args(p)
    p.set_defaults(func=run)


def run_iteration(engine, prompts: list[list[int]], params, tag: str) -> dict:
    """Queue the prompts at once, step until all finish; per-request token timestamps."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    seen = dict.fromkeys(ids, 0)
    times: dict[str, list[float]] = {i: [] for i in ids}
    done = 0
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params, cache_salt=tag)
    while done < len(ids):
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            n = len(output.outputs[0].token_ids)
            times[output.request_id] += [now] * (n - seen[output.request_id])
            seen[output.request_id] = n
            done += output.finished
    wall = time.perf_counter() - start
    while engine.has_unfinished_requests():  # hand the last finished ids to the worker (untimed)
        engine.step()
    ttft, itl, e2e, tpot = [], [], [], []
    for stamps in times.values():
        ttft.append(stamps[0] - start)
        e2e.append(stamps[-1] - start)
        itl += [b - a for a, b in zip(stamps, stamps[1:])]
        if len(stamps) > 1:
            tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {"wall": wall, "ttft": ttft, "itl": itl, "e2e": e2e, "tpot": tpot,
            "generated_tokens": sum(seen.values())}


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from blockserve.sampling_params import SamplingParams

    sizes = list(dict.fromkeys(args.batch_sizes))
    if min(sizes) < 1 or args.num_iters < 1 or args.num_warmup_iters < 0 or args.max_tokens < 1:
        raise ValueError("--batch-sizes, --num-iters and --max-tokens must be positive, --num-warmup-iters >= 0")
    flags_config, loaded = load_for_bench(args)
    prompts_by_size = {b: bench_prompts(args, loaded, b) for b in sizes}
    kind = prompts_by_size[sizes[0]][1]
    biggest = prompts_by_size[max(sizes)][0]
    config = engine_config_for(flags_config, loaded, [len(p) + args.max_tokens for p in biggest],
                               args.kv_cache_memory is None)
    env = environment()
    print_environment(env)
    print(f"model: {loaded.source}; workload: {kind}, {args.max_tokens} new tokens per request, greedy, EOS ignored; "
          f"batch sizes {sizes}, {args.num_warmup_iters} warm-up + {args.num_iters} timed iteration(s) each")

    engine = new_engine(config, loaded)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    per_size = []
    iters = args.num_warmup_iters + args.num_iters
    with tqdm(total=len(sizes) * iters, desc="latency", unit="iter", disable=args.no_progress) as bar:
        for b in sizes:
            prompts = prompts_by_size[b][0]
            timed = []
            for it in range(iters):
                bar.set_postfix(batch=b)
                res = run_iteration(engine, prompts, params, f"lat-b{b}-i{it}")
                expected = b * args.max_tokens
                if res["generated_tokens"] != expected:
                    raise RuntimeError(f"batch {b}: generated {res['generated_tokens']} tokens, expected {expected}")
                if it >= args.num_warmup_iters:
                    timed.append(res)
                bar.update(1)
            walls = [r["wall"] for r in timed]
            lens = [len(p) for p in prompts]
            per_size.append({
                "batch_size": b, "prompt_len_mean": statistics.fmean(lens), "prompt_len_max": max(lens),
                "max_tokens": args.max_tokens, "iterations": len(timed),
                "generated_tokens_per_iteration": timed[0]["generated_tokens"],
                "ttft_ms": summarize([x for r in timed for x in r["ttft"]], 1e3),
                "itl_ms": summarize([x for r in timed for x in r["itl"]], 1e3),
                "tpot_ms": summarize([x for r in timed for x in r["tpot"]], 1e3),
                "e2e_ms": summarize([x for r in timed for x in r["e2e"]], 1e3),
                "iteration_seconds": walls,
                "generated_tokens_per_s": statistics.median(r["generated_tokens"] / r["wall"] for r in timed),
            })
    env["load_average_end"] = list(os.getloadavg())
    threads = thread_settings()
    results = {"benchmark": "latency", "thread_settings": threads, "environment": env, "args": args_record(args),
               "engine": engine_record(config), "workload": {"kind": kind, "max_tokens": args.max_tokens},
               "batch_sizes": per_size, "roofline": None}

    print(f"\n== bench latency: {kind}, {args.max_tokens} new tokens; threads: torch {threads['torch_num_threads']}, "
          f"OMP_NUM_THREADS={threads['OMP_NUM_THREADS']}, OMP_WAIT_POLICY={threads['OMP_WAIT_POLICY']} ==")
    for s in per_size:
        print(f"batch {s['batch_size']} (prompts mean {s['prompt_len_mean']:.0f} tokens, {s['iterations']} iterations, "
              f"{s['generated_tokens_per_s']:.1f} generated tok/s):")
        for name in ("ttft", "itl", "tpot", "e2e"):
            print("  " + format_summary(name.upper(), s[f"{name}_ms"]))
    if not args.no_roofline:
        results["roofline"] = _bandwidth_bound(loaded, per_size)
    write_json(args.output_json, results)
    return 0


def _bandwidth_bound(loaded, per_size: list[dict]) -> dict | None:
    from blockserve.bench.roofline import ModelShape, batch1_bandwidth_bound, loaded_bound_line

    try:
        shape = ModelShape.of(loaded.model, loaded.hf_config)
    except AttributeError as e:
        print(f"roofline: not available for this model ({e})")
        return None
    bound = batch1_bandwidth_bound(shape)
    ms = bound["batch1_loaded_bound_ms_per_token"]
    line = (f"batch-1 weight-bandwidth bound: {bound['weight_bytes_per_token'] / 1e6:.0f} MB of fp32 weights per token "
            f"at {bound['copy_bandwidth_gbs']:.1f} GB/s copy bandwidth -> "
            f"{bound['batch1_bandwidth_bound_ms_per_token']:.1f} ms/token")
    loaded_line = loaded_bound_line(bound)
    if loaded_line:
        line += "\n" + loaded_line
    one = next((s for s in per_size if s["batch_size"] == 1), None)
    if one is not None and one["itl_ms"]["median"]:
        bound["batch1_itl_fraction_of_bound"] = ms / one["itl_ms"]["median"]
        line += (f"; batch-1 median ITL {one['itl_ms']['median']:.1f} ms runs at "
                 f"{100 * bound['batch1_itl_fraction_of_bound']:.0f}% of the bound's speed")
    print(line)
    return bound
