"""The OpenMP wait policy blockserve's commands run with (torch's CPU kernels use libgomp).

A thread that finishes its share of a parallel region either spins (a fast hand-off to the next
region, but it holds a core a neighbouring process may need) or sleeps (a futex wake-up per
region: ~100 us on a VM). A decode step runs a few hundred parallel regions (its matmuls, the LM
head, attention over long contexts) with microseconds of Python between them. Measured at 2
threads on a quiet 2-core Zen 3 (benchmarks/thread_policy.py, results/thread_policy_quiet.json):
batch-1 decode steps of 28.2 ms sleeping (OMP_WAIT_POLICY=PASSIVE), twice one thread's 13.5 ms,
and 12.4 ms spinning up to 100k iterations (GOMP_SPINCOUNT=100000; 130 vs 182 ms at 16 rows). So
`blockserve` starts with GOMP_SPINCOUNT=100000 unless the caller chose a policy themselves. Beside a
busy neighbour spinning collapses (110 ms per batch-1 step, results/thread_policy_loaded.json):
the engine then runs on fewer threads (engine/thread_governor.py), and one thread has no parallel
regions to spin in.

The runtime reads its environment once, when torch loads: `apply_defaults()` must run before
anything imports torch (blockserve.cli does it first thing). Pure Python, no torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULTS: dict[str, str] = {"GOMP_SPINCOUNT": "100000"}
# Any of these set by the caller is their choice of policy: the defaults then stay out.
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set DEFAULTS in `environ` unless the caller already chose a wait policy; returns what was set."""
    if any(key in environ for key in USER_CHOICES):
        return {}
    for key, value in DEFAULTS.items():
        environ[key] = value
    return dict(DEFAULTS)
