"""`blockserve bench serve`: a load generator against a running OpenAI-compatible server.

    blockserve serve --num-threads 1 &                        (or any OpenAI-compatible server)
    blockserve bench serve --base-url http://127.0.0.1:8000 --request-rate 0.5 1 2 --plot load.png
    blockserve bench serve --max-concurrency 8 --num-prompts 32 --max-tokens 64 --output-json serve.json
    blockserve bench serve --random-input-len 128 --random-vocab-size 512 --max-tokens 32

Requests stream through the openai AsyncOpenAI client: the fixed chat workload's conversations
through /v1/chat/completions (the server applies the chat template), or random token-id prompts
through /v1/completions (--random-input-len; ids below --random-vocab-size, which must not exceed
the model's vocabulary). Greedy, `ignore_eos`, so each request generates --max-tokens tokens.

Arrivals: Poisson at each --request-rate (requests/s; inf, the default, sends all at once),
optionally capped by --max-concurrency requests in flight; one full run per rate. Per request:
TTFT (send -> first content chunk), ITL (gaps between content chunks), E2E (send -> end of stream),
TPOT ((E2E - TTFT) / (completion tokens - 1)); token counts from the stream's usage. Reported per
load: medians, means, p90, p99 (ms), request and token throughput. `--plot out.png` draws TTFT,
ITL and E2E (median, p99) against the achieved load (matplotlib).

Thread settings recorded are the client's; the server's are whatever it was started with.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import time

from blockserve.bench.common import (add_workload_args, args_record, environment, format_summary,
                                         print_environment, summarize, thread_settings, write_json)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load generator against a running OpenAI-compatible server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY, or none)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default=None,
                   help="default: chat for the chat workload, completions for random prompts")
    add_workload_args(p)
    p.add_argument("--random-vocab-size", type=int, default=256, help="random prompt ids are drawn below this")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="Poisson arrival rates in requests/s, one run each (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--plot", default=None, help="draw latency against load into this PNG (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.set_defaults(func=run)


def build_requests(args: argparse.Namespace) -> tuple[list, str]:
    """(request payloads: chat messages or token-id prompts, a description)."""
    from blockserve.bench.workloads import CONVERSATIONS, random_prompts, render

    if args.random_input_len is not None:
        prompts = random_prompts(args.num_prompts, args.random_input_len, args.random_vocab_size, args.seed)
        return prompts, f"random token ids, {args.random_input_len} per prompt"
    # the fixed workload's conversations in list order, cycled past 64
    return ([render(CONVERSATIONS[i % len(CONVERSATIONS)]) for i in range(args.num_prompts)],
            "the fixed chat workload")


async def one_request(client, endpoint: str, model: str, payload, max_tokens: int, timeout: float) -> dict:
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=timeout)
    stamps: list[float] = []
    usage = None
    start = time.perf_counter()
    try:
        if endpoint == "chat":
            stream = await client.chat.completions.create(messages=payload, **common)
        else:
            stream = await client.completions.create(prompt=payload, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text = choice.delta.content if endpoint == "chat" else choice.text
                if text:
                    stamps.append(now)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if not stamps:
        return {"ok": False, "error": "the stream carried no content"}
    completion = usage.completion_tokens if usage is not None else len(stamps)
    return {
        "ok": True, "ttft": stamps[0] - start, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "e2e": end - start, "tpot": (end - stamps[0]) / (completion - 1) if completion > 1 else None,
        "completion_tokens": completion, "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "chunks": len(stamps),
    }


async def run_load(client, endpoint: str, model: str, payloads: list, args: argparse.Namespace, rate: float,
                   seed: int) -> dict:
    """One run: every payload, arriving as a Poisson process at `rate` (inf: at once)."""
    from tqdm import tqdm

    rng = random.Random(seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(payloads), desc=f"rate {rate:g}", unit="req", disable=args.no_progress, leave=False)
    in_flight = peak = 0

    async def send(payload) -> dict:
        nonlocal in_flight, peak
        if limit is not None:
            await limit.acquire()
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await one_request(client, endpoint, model, payload, args.max_tokens, args.timeout)
        finally:
            in_flight -= 1
            if limit is not None:
                limit.release()
            bar.update(1)

    start = time.perf_counter()
    tasks = []
    for i, payload in enumerate(payloads):
        tasks.append(asyncio.create_task(send(payload)))
        if math.isfinite(rate) and i < len(payloads) - 1:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()

    ok = [r for r in results if r["ok"]]
    completion = sum(r["completion_tokens"] for r in ok)
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    return {
        "request_rate": rate if math.isfinite(rate) else "inf", "max_concurrency": args.max_concurrency,
        "num_requests": len(payloads), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "duration_s": duration, "peak_in_flight": peak,
        "request_throughput": len(ok) / duration, "output_throughput": completion / duration,
        "total_token_throughput": (prompt + completion) / duration,
        "prompt_tokens": prompt, "completion_tokens": completion,
        "completion_tokens_per_request": [r["completion_tokens"] for r in ok],
        "ttft_ms": summarize([r["ttft"] for r in ok], 1e3),
        "itl_ms": summarize([x for r in ok for x in r["itl"]], 1e3),
        "tpot_ms": summarize([r["tpot"] for r in ok if r["tpot"] is not None], 1e3),
        "e2e_ms": summarize([r["e2e"] for r in ok], 1e3),
    }


async def _main(args: argparse.Namespace, payloads: list, endpoint: str) -> tuple[str, list[dict]]:
    import openai

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "none"
    async with openai.AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0,
                                  timeout=args.timeout) as client:
        model = args.model
        if model is None:
            try:
                models = await client.models.list()
            except openai.APIError as e:
                raise ValueError(f"cannot list the models of {args.base_url}: {e}") from None
            model = models.data[0].id
        loads = []
        for k, rate in enumerate(args.request_rate):
            load = await run_load(client, endpoint, model, payloads, args, rate, args.seed + k)
            loads.append(load)
            print(f"rate {rate:g} req/s: {load['completed']}/{load['num_requests']} completed in "
                  f"{load['duration_s']:.2f} s, {load['request_throughput']:.3f} req/s, "
                  f"{load['output_throughput']:.1f} output tok/s")
            for error in load["errors"]:
                print(f"  error: {error}")
    return model, loads


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be positive")
    if any(not rate > 0 for rate in args.request_rate):
        raise ValueError("--request-rate values must be positive (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be positive")
    payloads, kind = build_requests(args)
    endpoint = args.endpoint or ("completions" if args.random_input_len is not None else "chat")
    if endpoint == "chat" and args.random_input_len is not None:
        raise ValueError("random token-id prompts go through --endpoint completions")
    env = environment()
    print_environment(env)
    print(f"server {args.base_url} (/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}); workload: "
          f"{kind}, {len(payloads)} requests, {args.max_tokens} new tokens each, greedy, EOS ignored; "
          f"rates {args.request_rate} req/s, max concurrency {args.max_concurrency}")
    model, loads = asyncio.run(_main(args, payloads, endpoint))
    env["load_average_end"] = list(os.getloadavg())
    threads = thread_settings()
    results = {"benchmark": "serve", "thread_settings": threads, "thread_settings_are": "the client's",
               "environment": env, "args": args_record(args), "base_url": args.base_url, "model": model,
               "endpoint": endpoint, "workload": {"kind": kind, "num_prompts": len(payloads),
                                                  "max_tokens": args.max_tokens}, "loads": loads}
    print(f"\n== bench serve: {model} at {args.base_url}; client threads: torch {threads['torch_num_threads']}, "
          f"OMP_NUM_THREADS={threads['OMP_NUM_THREADS']}, OMP_WAIT_POLICY={threads['OMP_WAIT_POLICY']} ==")
    for load in loads:
        print(f"rate {load['request_rate']} req/s, max concurrency {load['max_concurrency']}: "
              f"{load['request_throughput']:.3f} req/s, {load['output_throughput']:.1f} output tok/s, "
              f"{load['total_token_throughput']:.1f} total tok/s, {load['failed']} failed")
        for name in ("ttft", "itl", "tpot", "e2e"):
            print("  " + format_summary(name.upper(), load[f"{name}_ms"]))
    if args.plot:
        plot(loads, args.plot, f"{model}: {kind}, {args.max_tokens} new tokens")
        results["plot"] = args.plot
    write_json(args.output_json, results)
    return 0 if all(load["failed"] == 0 for load in loads) else 1


def plot(loads: list[dict], path: str, title: str) -> None:
    """TTFT, ITL and E2E (median and p99) against the achieved request throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(loads) < 2:
        print("note: one load point only; give several --request-rate values for a curve")
    loads = sorted(loads, key=lambda load: load["request_throughput"])
    x = [load["request_throughput"] for load in loads]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (name, label) in zip(axes, (("ttft", "time to first token"), ("itl", "inter-token latency"),
                                        ("e2e", "end-to-end latency"))):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(x, [load[f"{name}_ms"][stat] or math.nan for load in loads], style, label=stat)
        for xi, load in zip(x, loads):
            ax.annotate(f"{load['request_rate']}", (xi, load[f"{name}_ms"]["median"] or 0), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_title(label)
        ax.set_xlabel("achieved load (requests/s); offered rate annotated")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
