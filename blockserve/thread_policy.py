"""The OpenMP wait policy blockserve's commands run with (torch's CPU kernels use libgomp).

A thread that finishes its share of a parallel region either spins (a fast hand-off to the next
region, but it holds a core another thread may need) or sleeps (a futex wake-up per region).
Every command sleeps (OMP_WAIT_POLICY=PASSIVE) unless the caller chose a policy (USER_CHOICES).
Why: a decode step's native calls run on blockserve's own task pool (native/csrc/task_pool.h) and
open few OpenMP regions, so spinning workers mostly take cores from it and from other processes
(measured in docs/performance.md). Beside busy processes the engine also runs on fewer threads
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
    environ.update(DEFAULTS)
    return dict(DEFAULTS)
