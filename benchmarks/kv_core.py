"""KV core micro-benchmarks: allocate+free cycles, prefix-hash throughput, cache-hit lookup.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.kv_core [--repeats 7] [--min-time 0.2] [--json [PATH]]

Allocate+free: a request is admitted (`allocate_slots` for 1, 16 or 256 blocks' worth of tokens,
block_size 16), freed, and the step's `take_pending()` drained; zeroing off, prefix caching on
but nothing cached. Run on one full-attention group and on a full +
sliding-window (window 1024) hybrid.

Hashing: 4096 blocks of 16 token ids hashed as a chain the way `BlockHashChain.get` does it
(ids packed as uint32 once, then parent digest + extra keys + the block's bytes per block), once
per hash function, in the same loop: sha256 (what hashing.py uses), blake2b (32-byte digest) and
xxh3_128 (xxhash). The real `BlockHashChain` (sha256) is timed too, as a check that the
stand-in costs what it does.

Cache hit: a 4096-token prompt whose 256 blocks are all cached; `get_computed_blocks` for a new
request with that prompt. "cold" includes hashing the new request's blocks (what admission
pays); "warm" reuses its memoized hashes (the lookup alone).

Every figure is the median of `--repeats` runs, each timed with time.perf_counter over enough
iterations to last `--min-time` seconds, with the garbage collector off (as timeit does); the
runs of the figures in one table are interleaved, so that a change in machine load (this is
often a shared machine: the load average is recorded) falls on all of them alike. The
KV core is single-threaded pure Python (no torch, no numpy: checked), so thread settings cannot
change these figures; they are recorded anyway.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import ssl
import statistics
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import xxhash

from blockserve.kv import (
    BlockHashChain,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheManager,
    SlidingWindowSpec,
)
from blockserve.kv.hashing import extra_keys_bytes

BLOCK_SIZE = 16
FULL = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bfloat16")
SLIDING = SlidingWindowSpec(BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=1024)
LAYOUTS = {"full": (FULL,), "full+sliding": (FULL, SLIDING)}
HASH_BLOCKS = 4096
PROMPT_TOKENS = 4096
VOCAB = 32000
ROOT = b"blockserve-prefix-v1"  # hashing.py's chain root
DEFAULT_JSON = Path(__file__).resolve().parents[1] / "results" / "kv_core.json"

HASHES = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "blake2b": lambda data: hashlib.blake2b(data, digest_size=32).digest(),
    "xxh3_128": lambda data: xxhash.xxh3_128_digest(data),  # a lambda too, so every call costs alike
}


@dataclass
class Req:
    request_id: str
    token_ids: list[int]
    block_hashes: BlockHashChain
    num_computed_tokens: int = 0


def manager_for(layout: str, num_blocks: int) -> KVCacheManager:
    groups = tuple(KVCacheGroup(spec, num_blocks, zero_new_blocks=False) for spec in LAYOUTS[layout])
    return KVCacheManager(KVCacheConfig(groups))


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % VOCAB for i in range(n)]


def measure(fns: dict, repeats: int, min_time: float) -> dict[str, float]:
    """Median seconds per call of each of `fns`: each is calibrated to last `min_time` a run, then
    the runs are interleaved (one of each per round), so a change in machine load hits all alike."""
    calls = {}
    for name, fn in fns.items():
        n = 1
        while (elapsed := _time(fn, n)) < min_time / 5:  # calibrate, as timeit.autorange does
            n *= 2
        calls[name] = max(1, round(n * min_time / elapsed))
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(_time(fn, calls[name]) / calls[name])
    return {name: statistics.median(times) for name, times in runs.items()}


def _time(fn, calls: int) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


# -- the three benchmarks ------------------------------------------------------------------------


def alloc_free_cycle(layout: str, blocks_per_call: int):
    """A request admitted for `blocks_per_call` blocks in every group, freed, and the step drained."""
    num_tokens = blocks_per_call * BLOCK_SIZE
    manager = manager_for(layout, num_blocks=blocks_per_call + 1)
    req = Req("r", tokens(num_tokens), manager.new_block_hashes())

    def cycle():
        manager.allocate_slots(req, num_tokens)
        manager.free("r")
        manager.take_pending()

    ids = manager.allocate_slots(req, num_tokens)
    assert [len(t) for t in ids] == [blocks_per_call] * len(LAYOUTS[layout])
    manager.free("r")
    manager.assert_idle()
    return cycle


def hash_chain(hash_fn, token_ids: list[int]):
    """`BlockHashChain.get` over all of `token_ids` with its hash function swapped for `hash_fn`:
    the ids packed as uint32 once, then one hash per block of parent + extra keys + the block."""
    extra, width = extra_keys_bytes("tenant", None), 4 * BLOCK_SIZE

    def run():
        data = array("I", token_ids).tobytes()
        parent = ROOT
        for offset in range(0, len(data), width):
            parent = hash_fn(parent + extra + data[offset : offset + width])
        return parent

    return run


def real_chain(token_ids: list[int]):
    """hashing.py itself, checked to give the stand-in's digests."""

    def run():
        return BlockHashChain([BLOCK_SIZE], cache_salt="tenant").get(BLOCK_SIZE, token_ids)

    assert run()[-1] == hash_chain(HASHES["sha256"], token_ids)(), "the stand-in chain differs from hashing.py"
    return run


def cache_hit_lookup(layout: str, warm: bool):
    """`get_computed_blocks` for a prompt whose every block is cached (evictable, as after a finish)."""
    prompt = tokens(PROMPT_TOKENS, seed=1)
    manager = manager_for(layout, num_blocks=PROMPT_TOKENS // BLOCK_SIZE + 2)
    first = Req("first", prompt, manager.new_block_hashes())
    manager.allocate_slots(first, PROMPT_TOKENS)
    manager.cache_blocks(first, PROMPT_TOKENS)
    manager.free("first")
    warm_req = Req("warm", prompt, manager.new_block_hashes())
    # A hit leaves a token to compute, so it is one block short of the prompt.
    assert manager.get_computed_blocks(warm_req).num_tokens == PROMPT_TOKENS - BLOCK_SIZE
    if warm:
        return lambda: manager.get_computed_blocks(warm_req)
    return lambda: manager.get_computed_blocks(Req("cold", prompt, manager.new_block_hashes()))


# -- reporting -----------------------------------------------------------------------------------


def environment() -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = None
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        "threads_used": 1,  # pure Python, single-threaded
        "torch_imported": "torch" in sys.modules,
        "numpy_imported": "numpy" in sys.modules,
        "openssl": ssl.OPENSSL_VERSION,
        "xxhash": xxhash.VERSION,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per figure; the median is reported")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds each timed run lasts at least")
    parser.add_argument("--json", nargs="?", const=DEFAULT_JSON, type=Path, metavar="PATH",
                        help=f"also write the results as JSON (default path: {DEFAULT_JSON})")
    args = parser.parse_args()

    def timed(fns: dict) -> dict[str, float]:
        return measure(fns, args.repeats, args.min_time)

    env = environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"median of {args.repeats} interleaved runs of >= {args.min_time} s each, gc off while timing\n")
    results: dict = {"environment": env, "repeats": args.repeats, "min_time_s": args.min_time}

    print(f"{'allocate+free cycles':<28} {'blocks/call':>11} {'cycles/s':>12} {'us/cycle':>9} {'blocks/s':>12}")
    cases = [(layout, blocks) for layout in LAYOUTS for blocks in (1, 16, 256)]
    seconds = timed({case: alloc_free_cycle(*case) for case in cases})
    results["alloc_free"] = []
    for (layout, blocks), t in seconds.items():
        results["alloc_free"].append({"layout": layout, "blocks_per_call": blocks, "cycles_per_s": 1 / t,
                                      "us_per_cycle": t * 1e6, "blocks_per_s": blocks / t})
        print(f"{layout:<28} {blocks:>11} {1 / t:>12,.0f} {t * 1e6:>9.1f} {blocks / t:>12,.0f}")

    print(f"\n{'hashing, 16-token blocks':<28} {'blocks/s':>12} {'us/block':>9} {'vs sha256':>10}")
    token_ids = tokens(BLOCK_SIZE * HASH_BLOCKS)
    fns = {name: hash_chain(fn, token_ids) for name, fn in HASHES.items()}
    fns["BlockHashChain (sha256)"] = real_chain(token_ids)
    per_block = {name: t / HASH_BLOCKS for name, t in timed(fns).items()}
    results["hashing"] = {}
    for name, t in per_block.items():
        ratio = per_block["sha256"] / t
        results["hashing"][name] = {"blocks_per_s": 1 / t, "us_per_block": t * 1e6, "speed_vs_sha256": ratio}
        print(f"{name:<28} {1 / t:>12,.0f} {t * 1e6:>9.3f} {ratio:>9.2f}x")

    print(f"\n{'cache hit, 4096-token prompt':<28} {'lookup':>8} {'median us':>10}")
    cases = [(layout, kind) for layout in LAYOUTS for kind in ("cold", "warm")]
    seconds = timed({case: cache_hit_lookup(case[0], warm=case[1] == "warm") for case in cases})
    results["cache_hit"] = []
    for (layout, kind), t in seconds.items():
        results["cache_hit"].append({"layout": layout, "lookup": kind, "us": t * 1e6})
        print(f"{layout:<28} {kind:>8} {t * 1e6:>10.1f}")

    assert "torch" not in sys.modules and "numpy" not in sys.modules
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
