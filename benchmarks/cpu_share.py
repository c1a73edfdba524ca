"""The other processes' share of the machine's CPUs while this one measured something.

    with CpuShare() as share:
        ...                       # the measured work, in this process
    share.others                  # (busy CPU time of the usable CPUs - this process's) / (wall x CPUs)

From /proc/stat (every process's busy time) and os.times() (this process's, threads included),
as the engine's thread governor reads them;
None where /proc/stat cannot be read. A figure taken while `others` is large measured the neighbours.
"""

from __future__ import annotations

import time

from blockserve.engine.thread_governor import machine_busy_seconds as _busy_seconds
from blockserve.engine.thread_governor import own_busy_seconds as _own_seconds
from blockserve.engine.thread_governor import usable_cpus


class CpuShare:
    def __enter__(self) -> CpuShare:
        self._busy, self._own, self._wall = _busy_seconds(), _own_seconds(), time.perf_counter()
        self.others: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        busy, wall = _busy_seconds(), time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return
        others = max(0.0, (busy - self._busy) - (_own_seconds() - self._own))
        self.others = min(1.0, others / (wall * len(usable_cpus())))
