"""The OpenMP wait policy blockserve's commands run with (torch's CPU kernels use libgomp).

A thread that finishes its share of a parallel region either spins (a fast hand-off to the next
region, but it holds a core another thread may need) or sleeps (a futex wake-up per region: ~100 us
on a VM). Every command sleeps (OMP_WAIT_POLICY=PASSIVE) unless the caller chose a policy.

Until issue 16's part 15 the offline commands (generate, chat, bench) spun up to 100k iterations
(GOMP_SPINCOUNT=100000): when every kernel of a decode step split on OpenMP, spinning gave batch-1
steps of 12.4 against 28.2 ms sleeping on a 2-core Zen 3 (results/thread_policy_quiet.json). Since
then the calls of a decode step run on a pool of blockserve's own that spins only between the calls
of a step (attention/csrc/task_pool.h), and the sampler is one native call (csrc/sample.cpp): a
decode step of 1 row opens no OpenMP region at all (counted with an LD_PRELOAD shim over
GOMP_parallel, greedy and sampled alike) and one of 64 rows about eight. Spinning OpenMP workers
then only compete with the pool's worker for the second core: on a 2-core Zen 5, 16 and 64 running
requests decode faster sleeping (benchmarks/thread_policy.py), and offline batch 64 runs faster
sleeping in 7 of 9 pairs (docs/performance.md part 15). A spinning thread also collapses whenever
another process wants its core: beside a busy process 110 ms per step instead of ~13
(results/thread_policy_loaded.json), and in `blockserve serve`, whose HTTP thread wakes for every
streamed token, one client's TPOT went from 22 to 33 ms. Beside busy processes the engine also
runs on fewer threads (engine/thread_governor.py).

The runtime reads its environment once, when torch loads: `apply_defaults()` must run before
anything imports torch (blockserve.cli does it first thing). Pure Python, no torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}
# Any of these set by the caller is their choice of policy: the defaults then stay out.
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set DEFAULTS in `environ` unless the caller already chose a wait policy; returns what was set."""
    if any(key in environ for key in USER_CHOICES):
        return {}
    environ.update(DEFAULTS)
    return dict(DEFAULTS)
