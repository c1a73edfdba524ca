"""What every runner returns: one timed run of a system over the whole workload."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field


@dataclass
class RunResult:
    seconds: float
    tokens: int
    requests: int
    cpu_seconds: float  # process CPU time (all threads) over the run
    load_average: float  # 1-minute load average at the start of the run
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "tokens": self.tokens, "requests": self.requests, "tok_s": self.tok_s,
                "req_s": self.requests / self.seconds, "cpu_per_wall": self.cpu_seconds / self.seconds,
                "load_average_1m": self.load_average, **self.extra}


def timed(fn):
    """(fn(), wall seconds, process CPU seconds, 1-minute load average at the start)."""
    load = os.getloadavg()[0]
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    value = fn()
    t1, c1 = time.perf_counter(), time.process_time()
    return value, t1 - t0, c1 - c0, load


def check_counts(system: str, tokens: list[list[int]], max_tokens: int) -> None:
    """Every generation has exactly max_tokens tokens (EOS ignored), or the run is void."""
    if any(len(t) != max_tokens for t in tokens):
        raise RuntimeError(f"{system} generated {[len(t) for t in tokens]} tokens, expected {max_tokens} each")
