"""C2 soak: a long stream of `max_tokens=1` requests with short shared prefixes.

Every step, right after `schedule()`, every per-step buffer must be empty and the KV managers
must hold entries only for running requests. Host memory (tracemalloc and RSS) is sampled after
warm-up and at the end; it must stay flat.

    python -m blockserve.sim.soak --requests 100000
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
import tracemalloc
from dataclasses import dataclass

from blockserve.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroup, LinearStateSpec, SlidingWindowSpec
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler import Request, Scheduler, SchedulerConfig
from blockserve.sim.drive import Arrival, build, run_stream


@dataclass(frozen=True)
class SoakReport:
    num_requests: int
    num_steps: int
    seconds: float
    traced_warm_bytes: int
    traced_end_bytes: int
    rss_warm_bytes: int
    rss_end_bytes: int
    checkpoint_restores: int = 0

    @property
    def traced_growth(self) -> int:
        return self.traced_end_bytes - self.traced_warm_bytes

    @property
    def rss_growth(self) -> int:
        return self.rss_end_bytes - self.rss_warm_bytes

    def __str__(self) -> str:
        mib = 2**20
        return (
            f"{self.num_requests} requests, {self.num_steps} steps, {self.checkpoint_restores} state restores; "
            f"untraced half in {self.seconds:.1f} s\n"
            f"RSS over the untraced half: {self.rss_warm_bytes / mib:.1f} -> {self.rss_end_bytes / mib:.1f} MiB "
            f"(growth {self.rss_growth / 1024:+.1f} KiB)\n"
            f"tracemalloc over the traced half, after its warm-up: {self.traced_warm_bytes / 1024:.1f} -> "
            f"{self.traced_end_bytes / 1024:.1f} KiB (growth {self.traced_growth / 1024:+.1f} KiB)"
        )


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: peak RSS is the best the platform offers
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def assert_buffers_drained(scheduler: Scheduler) -> None:
    """Right after schedule(): nothing accumulates for later, nothing is kept for finished requests."""
    assert scheduler.kv.pending_is_empty(), "KV pending work survived schedule()"
    assert not scheduler._finished_ids, "finished ids survived schedule()"
    live = set(scheduler.requests)
    coordinator = scheduler.kv.coordinator
    assert set(coordinator.steady) <= live and set(coordinator.next_cache_at) <= live, "per-request limits leak"
    for manager in scheduler.kv.coordinator.managers:
        assert set(manager.req_blocks) <= live, "a KV manager keeps blocks of a finished request"
        assert set(manager.num_cached) <= live, "a KV manager keeps cache counts of a finished request"
    for manager in coordinator.state_managers:
        assert not manager.pins(), "checkpoint pins survived schedule()"
        assert set(manager._capturing) | set(manager._spare) <= live, "a state manager keeps a finished request's checkpoints"
    assert set(scheduler.kv._plans) <= live, "capture plans of finished requests leak"


def soak(num_requests: int, per_step: int = 16, warmup: int = 2000, seed: int = 0, hybrid: bool = False) -> SoakReport:
    """`hybrid`: full attention plus a recurrent-state group with 32 checkpoint slots (stride 16),
    instead of full plus sliding-window attention."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64)
    if hybrid:
        state = LinearStateSpec(shapes=((8, 3), (2, 8, 8)), dtypes=("float32", "float32"), chunk_size=16)
        second = KVCacheGroup(state, 65, True, ("state",), num_checkpoints=32)
    else:
        window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, sliding_window=32)
        second = KVCacheGroup(window, 257, True, ("sliding",))
    kv_config = KVCacheConfig((KVCacheGroup(spec, 257, True, ("full",)), second))
    sched_config = SchedulerConfig(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=1024)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randrange(8, 40))] for _ in range(8)]

    def arrivals(start: int, count: int):
        for i in range(count):
            tokens = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(rng.randrange(1, 8))]
            request = Request(f"req-{start + i}", tokens, SamplingParams(max_tokens=1), arrival_time=float(start + i))
            yield Arrival(i // per_step, request)

    scheduler, runner = build(kv_config, sched_config, (True, not hybrid), vocab_size=32000)

    def run(start: int, count: int) -> int:
        return run_stream(
            scheduler, runner, arrivals(start, count), check=False, after_schedule=assert_buffers_drained,
            keep_outputs=False,
        ).num_steps

    warm = min(warmup, num_requests)
    steps = run(0, warm)
    # RSS first, without tracemalloc (whose own bookkeeping would inflate it), then the traced run.
    half = (num_requests - warm) // 2
    rss_warm = _rss_bytes()
    start = time.perf_counter()
    steps += run(warm, half)
    seconds = time.perf_counter() - start
    rss_end = _rss_bytes()
    # Traced from before a second warm-up, so slots refilled in kind do not count as growth.
    tracemalloc.start()
    rest = num_requests - warm - half
    second_warm = min(warm, rest // 2)
    steps += run(warm + half, second_warm)
    traced_warm = tracemalloc.get_traced_memory()[0]
    steps += run(warm + half + second_warm, rest - second_warm)
    traced_end = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    scheduler.assert_idle()
    assert not runner.seqs, "the runner still holds requests"
    return SoakReport(num_requests, steps, seconds, traced_warm, traced_end, rss_warm, rss_end,
                      scheduler.kv.prefix_cache_stats().checkpoint_restores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--max-growth-mib", type=float, default=1.0)
    parser.add_argument("--hybrid", action="store_true", help="attention + recurrent state with checkpoints")
    args = parser.parse_args(argv)
    report = soak(args.requests, hybrid=args.hybrid)
    print(report)
    ok = max(report.traced_growth, report.rss_growth) < args.max_growth_mib * 2**20
    print("PASS" if ok else f"FAIL: memory grew by more than {args.max_growth_mib} MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
