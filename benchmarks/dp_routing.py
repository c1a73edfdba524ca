"""Prefix-aware routing against round robin, at `blockserve serve --data-parallel-size 2`.

A multi-tenant shared-prefix workload: each tenant (its own cache_salt) has a long system prompt
shared by all its requests, each request a fresh question, through /v1/chat/completions (so
the front end tokenizes through the chat template). The requests go in a shuffled order,
`--concurrency` at a time, to a fresh server per policy. Reported per policy: the prefix-cache
hit rate (prompt tokens found cached / prompt tokens looked up, summed over the replicas'
/metrics), requests and output tokens per second, the mean latency, and the router's reasons.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.dp_routing            # bundled SmolLM2
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.dp_routing --tenants 8 --requests-per-tenant 8

Raw figures go to results/dp_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx

TOPICS = ["astronomy", "gardening", "tax law", "chess openings", "bread baking", "railway history", "sailing",
          "beekeeping", "volcanoes", "jazz harmony", "medieval castles", "origami"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(tenant: int, words: int) -> str:
    topic = TOPICS[tenant % len(TOPICS)]
    rng = random.Random(tenant)
    filler = " ".join(rng.choice(["answer", "briefly", "politely", "with care", "citing facts", "in plain words",
                                  "for beginners", "about " + topic]) for _ in range(words))
    return f"You are tenant {tenant}'s assistant, an expert on {topic}. House rules: {filler}."


def workload(tenants: int, per_tenant: int, prefix_words: int, seed: int) -> list[tuple[int, list[dict]]]:
    requests = [(t, [{"role": "system", "content": system_prompt(t, prefix_words)},
                     {"role": "user",
                      "content": f"Question {q}: name one fact about {TOPICS[(t + q) % len(TOPICS)]}."}])
                for t in range(tenants) for q in range(per_tenant)]
    random.Random(seed).shuffle(requests)
    return requests


def metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


async def drive(port: int, requests, concurrency: int, max_tokens: int) -> dict:
    base = f"http://127.0.0.1:{port}"
    semaphore = asyncio.Semaphore(concurrency)
    latencies, output_tokens = [], 0
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(tenant: int, messages: list[dict]) -> None:
            nonlocal output_tokens
            async with semaphore:
                start = time.perf_counter()
                answer = await client.post(f"{base}/v1/chat/completions", json={
                    "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "cache_salt": f"tenant-{tenant}"})
                answer.raise_for_status()
                latencies.append(time.perf_counter() - start)
                output_tokens += answer.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(t, m) for t, m in requests))
        elapsed = time.perf_counter() - start
        text = (await client.get(f"{base}/metrics")).text
    queries = metric_sum(text, "blockserve_prefix_cache_queries_total")
    hits = metric_sum(text, "blockserve_prefix_cache_hits_total")
    reasons = dict(re.findall(r'^blockserve_router_requests_total\{reason="(\w+)"\} (\S+)$', text, re.M))
    return {"requests": len(requests), "seconds": round(elapsed, 3),
            "requests_per_s": round(len(requests) / elapsed, 3),
            "output_tokens_per_s": round(output_tokens / elapsed, 2),
            "mean_latency_s": round(sum(latencies) / len(latencies), 3), "prefix_queried_tokens": int(queries),
            "prefix_hit_tokens": int(hits), "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "routed_by_reason": {k: int(float(v)) for k, v in reasons.items()}}


def serve(args, routing: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [sys.executable, "-m", "blockserve.cli", "-q", "serve", "--port", str(port), "--data-parallel-size",
               str(args.replicas), "--dp-routing", routing, "--num-threads", str(args.threads),
               "--max-model-len", "2048", *(["--model", args.model] if args.model else [])]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process, port
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server was not healthy in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="--num-threads of each replica")
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--requests-per-tenant", type=int, default=6)
    parser.add_argument("--prefix-words", type=int, default=120, help="words of each tenant's system prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/dp_routing.json")
    args = parser.parse_args()

    requests = workload(args.tenants, args.requests_per_tenant, args.prefix_words, args.seed)
    results = {}
    for routing in ("affinity", "round_robin"):
        process, port = serve(args, routing)
        try:
            results[routing] = asyncio.run(drive(port, requests, args.concurrency, args.max_tokens))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
        print(routing, json.dumps(results[routing]), flush=True)
    report = {"benchmark": "dp_routing", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
