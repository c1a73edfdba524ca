"""Scheduler step overhead: `schedule()` + `update_from_output()`, the model excluded.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.scheduler_overhead [--steps 200] [--repeats 3]
        [--running 64 256 1024] [--stream-prompt 512 --stream-shared 256] [--json PATH]
        [--profile [RUNNING ...]]

Decode: R requests with distinct 512-token prompts (one full-attention group, block_size 16,
blocks to spare, max_num_seqs and the token budget large enough that all R run, max_tokens
large so they keep decoding) are warmed up until every one is in steady decode; then N steps
are timed. The fabricated ModelRunnerOutput (one token per request whose prompt is done) is
built outside the timed region. Each configuration runs `--repeats` times, interleaved, and
the best median counts; the mean is shown too, since every
16th step fills a block in every request at once.

Stream: max_tokens=1 requests (default: 512-token prompts sharing a 256-token prefix) arrive
`--stream-batch` per step, prefix caching on, in a cache just large enough for one batch so
that blocks are evicted and reused; `add_request` + `schedule` + `update_from_output` are
timed (building the Request and the model output are not), per request.

No ratio against vLLM is printed: a peer figure counts only when measured in the same run,
and vLLM is not installed here. (For context only: vLLM 0.33's V1 scheduler has been quoted at
1.1 / 4.0 / 25.7 ms per step for 64 / 256 / 1024 running, measured elsewhere.) The scheduler is pure
single-threaded Python (it imports no torch and no numpy, which the script checks), so OMP and
thread settings cannot affect it; they are recorded anyway.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import statistics
import sys
import time

from blockserve.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheManager
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler import ModelRunnerOutput, Request, Scheduler, SchedulerConfig

BLOCK_SIZE = 16
PROMPT_LEN = 512
MAX_TOKENS = 8192
VOCAB = 32000


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_scheduler(num_seqs: int, num_tokens_per_seq: int, caching: bool, budget: int) -> Scheduler:
    num_blocks = num_seqs * cdiv(num_tokens_per_seq, BLOCK_SIZE) + 2
    spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bfloat16")
    group = KVCacheGroup(spec, num_blocks, zero_new_blocks=False)
    kv = KVCacheManager(KVCacheConfig((group,), enable_prefix_caching=caching))
    config = SchedulerConfig(max_model_len=PROMPT_LEN + MAX_TOKENS, max_num_seqs=num_seqs,
                             max_num_batched_tokens=budget)
    return Scheduler(config, kv)


def fabricate(scheduler: Scheduler, out, token: int) -> ModelRunnerOutput:
    """One token for each scheduled request whose prompt (and outputs so far) is all computed."""
    requests = scheduler.requests
    return ModelRunnerOutput({
        rid: [token] for rid in out.num_scheduled_tokens
        if requests[rid].num_computed_tokens == len(requests[rid].token_ids)
    })


class Timer:
    """Accumulates the time between start() and stop(), profiling it too when given a profiler."""

    def __init__(self, profiler: cProfile.Profile | None = None):
        self.profiler = profiler
        self.ns = 0

    def start(self) -> None:
        if self.profiler:
            self.profiler.enable()
        self._t0 = time.perf_counter_ns()

    def stop(self) -> None:
        self.ns += time.perf_counter_ns() - self._t0
        if self.profiler:
            self.profiler.disable()


def step(scheduler: Scheduler, token: int, timer: Timer) -> int:
    """One step, the scheduler's part timed; returns the number of requests scheduled."""
    timer.start()
    out = scheduler.schedule()
    timer.stop()
    runner_output = fabricate(scheduler, out, token)
    timer.start()
    scheduler.update_from_output(out, runner_output)
    timer.stop()
    return len(out.num_scheduled_tokens)


def decode_scheduler(running: int, caching: bool, steps: int) -> Scheduler:
    """`running` requests in steady decode, with blocks for `steps` more tokens each."""
    s = make_scheduler(running, PROMPT_LEN + steps + 64, caching, budget=running * PROMPT_LEN)
    for i in range(running):
        prompt = [(i * 7919 + j * 104729) % VOCAB for j in range(PROMPT_LEN)]  # distinct prompts
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), arrival_time=i))
    for t in range(8):  # prefill (one step), then a few decodes
        step(s, t, Timer())
    assert len(s.running) == running and all(r.num_output_tokens > 1 for r in s.running), "not in steady decode"
    return s


def time_decode(running: int, caching: bool, steps: int, profiler: cProfile.Profile | None = None) -> list[int]:
    s = decode_scheduler(running, caching, steps)
    gc.collect()
    times = []
    for t in range(steps):
        timer = Timer(profiler)
        assert step(s, 100 + t, timer) == running
        times.append(timer.ns)
    return times


def time_stream(num_requests: int, batch: int, prompt_len: int, shared_len: int,
                profiler: cProfile.Profile | None = None) -> list[float]:
    """Microseconds per request, one figure per step of `batch` max_tokens=1 arrivals."""
    s = make_scheduler(batch, prompt_len + 1, True, budget=batch * prompt_len)
    shared = [(j * 31) % VOCAB for j in range(shared_len)]
    per_request = []
    for b in range(num_requests // batch):
        requests = []
        for i in range(batch):
            n = b * batch + i
            own = [(n + j * 104729) % VOCAB for j in range(prompt_len - shared_len)]
            requests.append(Request(f"s{n}", shared + own, SamplingParams(max_tokens=1), arrival_time=n))
        timer = Timer(profiler)
        timer.start()
        for request in requests:
            s.add_request(request)
        timer.stop()
        assert step(s, 1, timer) == batch and not s.requests
        per_request.append(timer.ns / batch / 1e3)
    s.schedule()  # hand over the last finished ids
    s.assert_idle()
    assert s.kv.prefix_cache_stats().hits > 0
    return per_request[len(per_request) // 10 :]  # the first tenth warms up


def environment() -> dict:
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "threads_matter": False,  # single-threaded pure Python; checked below: no torch, no numpy
        "torch_imported": "torch" in sys.modules,
        "numpy_imported": "numpy" in sys.modules,
        "gc_enabled": gc.isenabled(),
    }


def print_profile(profiler: cProfile.Profile, title: str, units: int, unit: str, top: int) -> None:
    """The functions with the most own time in the timed regions, with their share of it."""
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    print(f"\nprofile: {title}; {total / units * 1e6:.1f} us per {unit} under cProfile")
    print(f"{'own %':>6} {'cum %':>6} {'calls/' + unit:>12}  function")
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (file, line, name), (cc, nc, tt, ct, _) in rows:
        where = f"{os.path.basename(file)}:{line}" if line else file
        print(f"{100 * tt / total:6.1f} {100 * ct / total:6.1f} {nc / units:12.1f}  {name} ({where})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs; the best median counts")
    parser.add_argument("--stream-requests", type=int, default=10240)
    parser.add_argument("--stream-batch", type=int, default=64, help="max_tokens=1 arrivals per step")
    parser.add_argument("--stream-prompt", type=int, default=PROMPT_LEN, help="stream prompt length")
    parser.add_argument("--stream-shared", type=int, default=PROMPT_LEN // 2, help="prefix all stream prompts share")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--profile", type=int, nargs="*", metavar="RUNNING",
                        help="also cProfile these running counts (default: the largest)")
    parser.add_argument("--top", type=int, default=25, help="functions shown per profile")
    args = parser.parse_args()

    env = environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    configs = [(r, c) for r in args.running for c in (True, False)]
    medians: dict[tuple[int, bool], list[float]] = {c: [] for c in configs}
    means: dict[tuple[int, bool], list[float]] = {c: [] for c in configs}
    stream: list[float] = []
    for _ in range(args.repeats):
        for running, caching in configs:
            times = time_decode(running, caching, args.steps)
            medians[running, caching].append(statistics.median(times) / 1e6)
            means[running, caching].append(statistics.fmean(times) / 1e6)
        stream.append(statistics.median(
            time_stream(args.stream_requests, args.stream_batch, args.stream_prompt, args.stream_shared)))

    results = []
    print(f"\ndecode, {PROMPT_LEN}-token prompts, block_size {BLOCK_SIZE}, best of {args.repeats} x {args.steps} steps")
    print(f"{'running':>7} {'caching':>7} {'median ms':>9} {'mean ms':>8} {'us/req':>7}")
    for running, caching in configs:
        best = min(medians[running, caching])
        mean = min(means[running, caching])
        row = {"running": running, "prefix_caching": caching, "median_ms_per_step": best, "mean_ms_per_step": mean,
               "us_per_request": best * 1e3 / running}
        results.append(row)
        print(f"{running:7d} {'on' if caching else 'off':>7} {best:9.3f} {mean:8.3f} {row['us_per_request']:7.2f}")
    best_stream = min(stream)
    stream_row = {"requests": args.stream_requests, "batch": args.stream_batch, "prompt_len": args.stream_prompt,
                  "shared_prefix_len": args.stream_shared, "us_per_request": best_stream}
    print(f"\nmax_tokens=1 stream, prefix caching on, {args.stream_batch} arrivals per step, "
          f"{args.stream_prompt}-token prompts sharing {args.stream_shared}: {best_stream:.1f} us/request")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "decode": results, "stream": stream_row}, f, indent=2)
        print(f"wrote {args.json}")
    if args.profile is not None:
        for running in args.profile or [max(args.running)]:
            for caching in (True, False):
                profiler = cProfile.Profile()
                time_decode(running, caching, args.steps, profiler)
                print_profile(profiler, f"{running} running, prefix caching {'on' if caching else 'off'}",
                              args.steps, "step", args.top)
        profiler = cProfile.Profile()
        time_stream(args.stream_requests, args.stream_batch, args.stream_prompt, args.stream_shared, profiler)
        print_profile(profiler, "max_tokens=1 stream", args.stream_requests, "request", args.top)


if __name__ == "__main__":
    main()
