"""The OpenMP wait policy blockserve's commands run with (torch's CPU kernels use libgomp).

A thread that finishes its share of a parallel region either spins (a fast hand-off to the next
region, but it holds a core a neighbouring process may need) or sleeps (a futex wake-up per
region). A decode step runs ~120 parallel regions (its matmuls; the small ops never split), with
tens of microseconds of Python between them. Measured at 2 threads on a shared 2-core Zen 3
(benchmarks/thread_policy.py, docs/performance.md): a short spin (GOMP_SPINCOUNT=10000, ~10 us)
was faster than sleeping at batch 1 (15.7 vs 21 ms), but at 16 rows it ran 2-2.4x slower beside a
busy neighbour (three runs of four), which sleeping never did. So `blockserve` starts with
OMP_WAIT_POLICY=PASSIVE, the safe one, unless the caller chose a policy themselves (set
GOMP_SPINCOUNT=10000 on a machine of your own). At one thread none of this matters: there are no
parallel regions.

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
