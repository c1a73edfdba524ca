"""The OpenMP wait policy blockserve's commands run with (torch's CPU kernels use libgomp).

A thread that finishes its share of a parallel region either spins (a fast hand-off to the next
region, but it holds a core another thread may need) or sleeps (a futex wake-up per region: ~100 us
on a VM). Measured at 2 threads on a quiet 2-core Zen 3 (benchmarks/thread_policy.py,
results/thread_policy_quiet.json, kernels splitting every ~30 us of work): spinning up to 100k
iterations (GOMP_SPINCOUNT=100000) gave batch-1 decode steps of 12.4 ms against 28.2 ms sleeping
(OMP_WAIT_POLICY=PASSIVE) and 13.5 ms at one thread; offline batch 64 (`blockserve bench
throughput`) ran at 166.8 generated tok/s spinning, 116.3 sleeping. But a spinning thread
collapses whenever another thread wants its core: beside a busy process 110 ms per step
(results/thread_policy_loaded.json), and in `blockserve serve`, whose HTTP thread wakes for every
streamed token, one client's TPOT went from 22 to 33 ms (benchmarks/peers/native.py). So the
policy depends on the command: `serve` sleeps (PASSIVE), the offline ones (generate, chat, bench)
spin up to 100k iterations, unless the caller chose a policy themselves. The calls too short
for a wake-up, a small batch's quantized matmuls and decode attention, run on a pool of their own
that spins only between the calls of a step (attention/csrc/task_pool.h); larger batches' attention
and the fused ops split on OpenMP only work that pays for a wake-up (~150 us a task). Beside busy processes the engine also runs on
fewer threads (engine/thread_governor.py).

The runtime reads its environment once, when torch loads: `apply_defaults()` must run before
anything imports torch (blockserve.cli does it first thing). Pure Python, no torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SERVER_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}  # `serve`: its HTTP thread needs a core too
OFFLINE_DEFAULTS: dict[str, str] = {"GOMP_SPINCOUNT": "100000"}  # every other command
# Any of these set by the caller is their choice of policy: the defaults then stay out.
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def defaults_for(command: str | None) -> dict[str, str]:
    """The policy `blockserve <command>` starts with (command: its first argument, None for none)."""
    return SERVER_DEFAULTS if command == "serve" else OFFLINE_DEFAULTS


def apply_defaults(command: str | None, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set `command`'s defaults in `environ` unless the caller already chose a wait policy; returns
    what was set."""
    if any(key in environ for key in USER_CHOICES):
        return {}
    chosen = defaults_for(command)
    environ.update(chosen)
    return dict(chosen)
