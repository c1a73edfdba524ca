"""The other processes' share of the machine's CPUs while this one measured something.

    with CpuShare() as share:
        ...                       # the measured work, in this process
    share.others                  # (busy CPU time of the machine - this process's) / (wall x CPUs)

From /proc/stat (every process's busy time) and os.times() (this process's, threads included);
None where /proc/stat cannot be read. A figure taken while `others` is large measured the neighbours.
"""

from __future__ import annotations

import os
import time


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


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
        self.others = min(1.0, others / (wall * (os.cpu_count() or 1)))
