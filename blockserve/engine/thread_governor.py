"""Torch's thread count, lowered while other processes keep the machine's cores busy.

Beside a busy neighbour every parallel region waits for the thread that lost its core, so the
engine runs on the cores the other processes leave (measured in docs/performance.md):

    others = (busy CPU time of the usable CPUs - this process's) / elapsed   (in cores, /proc/stat)
    threads = clamp(round(cores - others), 1, max_threads)               every `interval` seconds

So a neighbour using more than half a core takes one thread away, and when it stops the next sample
gives the thread back. Half a core is where, on a 2-core host, a second thread stops paying; a
lower threshold would also take a thread from a benchmark client or a quiet neighbour (a neighbour
shows as using less than its share while both threads run). Samples are taken as the engine steps,
so the first after an idle spell spans it; one that spans more than IDLE_GAP intervals with the
engine busy less than half of it is skipped: a client starting up beside an idle server would
otherwise take a thread from the first requests it sends. Where /proc/stat cannot be read the count
stays at max_threads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


IDLE_GAP = 2  # intervals without a step, most of them idle: that sample is skipped (ThreadGovernor.tick)


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset, `taskset`), or every CPU
    where the platform does not say."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def machine_busy_seconds(cpus: frozenset[int] | None = None) -> float | None:
    """CPU seconds every process has spent busy on `cpus` (None: usable_cpus()) since boot, from
    /proc/stat's per-CPU lines, or None without /proc/stat. Only the CPUs this process may use
    count: on a shared host the other CPUs' load takes no core from it."""
    cpus = usable_cpus() if cpus is None else cpus
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu"):
                    break  # the cpu lines come first
                if name == "cpu" or int(name[3:]) not in cpus:
                    continue
                fields = [int(x) for x in rest.split()]
                idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
                busy += sum(fields[:8]) - idle
    except (OSError, ValueError, IndexError):
        return None
    return busy / os.sysconf("SC_CLK_TCK")


def own_busy_seconds() -> float:
    """CPU seconds this process has spent busy (every thread)."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """`tick()` once per engine step: every `interval` seconds it samples the CPU counters and sets
    the thread count (`set_threads`) to what the other processes leave; returns the new count when
    it changed, else None."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], *, interval: float = 1.0,
                 cores: int | None = None, clock: Callable[[], float] = time.monotonic,
                 machine_busy: Callable[[], float | None] = machine_busy_seconds,
                 own_busy: Callable[[], float] = own_busy_seconds):
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads = self.threads = max_threads
        self.cores = cores or len(usable_cpus())
        self.interval = interval
        self._set_threads, self._clock, self._machine_busy, self._own_busy = set_threads, clock, machine_busy, own_busy
        self._last = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._machine_busy(), self._own_busy()

    def tick(self) -> int | None:
        if self.max_threads == 1 or self._clock() - self._last[0] < self.interval:
            return None
        (then, busy_then, own_then), now = self._last, self._sample()
        self._last = now
        if busy_then is None or now[1] is None:
            return None
        elapsed, own = now[0] - then, now[2] - own_then
        if elapsed > IDLE_GAP * self.interval and own < elapsed / 2:
            return None  # the engine sat idle: a neighbour's burst then (a client starting) says nothing of now
        others = max(0.0, (now[1] - busy_then) - own) / elapsed
        threads = max(1, min(self.max_threads, int(self.cores - others + 0.5)))
        if threads == self.threads:
            return None
        self.threads = threads
        self._set_threads(threads)
        return threads
