"""The OpenMP wait policy blockserve's commands run with (torch's CPU kernels use libgomp).

A thread that finishes its share of a parallel region either spins (a fast hand-off to the next
region, but it holds a core another thread may need) or sleeps (a futex wake-up per region: ~100 us
on a VM). Measured at 2 threads on a quiet 2-core Zen 3 (benchmarks/thread_policy.py,
results/thread_policy_quiet.json, kernels splitting every ~30 us of work): spinning up to 100k
iterations (GOMP_SPINCOUNT=100000) gave batch-1 decode steps of 12.4 ms against 28.2 ms sleeping
(OMP_WAIT_POLICY=PASSIVE) and 13.5 ms at one thread. But a spinning thread collapses whenever
another thread wants its core: beside a busy process 110 ms per step (results/thread_policy_loaded.json),
and in `blockserve serve`, whose HTTP thread wakes for every streamed token, one client's TPOT went
from 22 to 33 ms (benchmarks/peers/native.py). So `blockserve` starts with OMP_WAIT_POLICY=PASSIVE,
the safe one, unless the caller chose a policy themselves, and the native kernels split only work
that pays for a wake-up (~150 us a task); GOMP_SPINCOUNT=100000 is worth setting for offline runs
on a machine of your own. Beside busy processes the engine also runs on fewer threads
(engine/thread_governor.py).

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
    for key, value in DEFAULTS.items():
        environ[key] = value
    return dict(DEFAULTS)
