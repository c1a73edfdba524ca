"""The server soak: minutes of mixed load from a bounded load generator against a real
`blockserve serve` on loopback, then a report. `make soak-server MINUTES=30`, or

    python -m blockserve.sim.server_soak --minutes 5 [--clients 4] [--json out.json] [-- SERVE ARGS]

Load: `clients` threads, each sending one request at a time (so at most `clients` are in
flight), picking its next kind at random (seeded) from MIX:

    complete   a completion (prompt: a tenant's shared prefix + a question; its cache_salt)
    stream     the same, streamed; must end in [DONE] with no error event
    chat       a chat completion
    cancel     a stream the client drops after its first event (the server aborts it)
    bad        a request the server must refuse with a 400 (unknown field, bad JSON, n too large, ...)
    burst      eight max_tokens=1 completions back to back
    timeout    a long completion with request_timeout 0.05: must get 504

Report: requests served, answers by class (`unexpected` is every answer the kind did not
expect), p50/p99 latency of the served requests, the server's RSS at the end of the warm-up, the
middle and the end, and whether every KV block is free at the end (/metrics: no request running,
waiting or queued, KV usage 0 in every group). Stdlib only (http.client), Linux (/proc for RSS).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

MIX = {"complete": 5, "stream": 4, "chat": 3, "cancel": 2, "bad": 2, "burst": 1, "timeout": 1}
TENANTS = 3
SERVE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--num-threads", "1", "--max-n", "4")
QUESTIONS = ("What is the capital of France?", "Name three colours.", "Count from one to five.",
             "What is two plus two?", "Say hello in Spanish.", "Why is the sky blue?")
BAD_BODIES = (  # (path, body (bytes: sent as is), what the 400 must say)
    ("/v1/completions", {"prompt": "Hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", b'{"prompt": "Hi", "max_tok', "not valid JSON"),
    ("/v1/completions", {"prompt": "Hi", "n": 99}, "--max-n"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 7}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]},
     "tool"),
)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 60.0
    warmup_s: float = 15.0  # load runs from the start; RSS growth is measured from here
    clients: int = 4
    seed: int = 0
    max_tokens: int = 12
    rss_every_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s < self.duration_s or self.clients < 1 or self.max_tokens < 1:
            raise ValueError(f"need 0 <= warmup_s < duration_s, clients >= 1, max_tokens >= 1; got {self}")


@dataclass
class SoakReport:
    duration_s: float
    requests: int = 0  # answered requests (a burst counts each of its eight)
    served: int = 0  # 200s with their whole answer
    by_kind: Counter = field(default_factory=Counter)
    by_class: Counter = field(default_factory=Counter)  # served, refused, timed_out, cancelled, unexpected
    unexpected: list[str] = field(default_factory=list)  # the first 20, for the reader
    p50_s: float = 0.0
    p99_s: float = 0.0
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    rss_start_mib: float = 0.0  # at the end of the warm-up
    rss_middle_mib: float = 0.0
    rss_end_mib: float = 0.0
    blocks_free_at_end: bool = False
    final_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_end_mib - self.rss_start_mib

    def as_dict(self) -> dict:
        """The report as JSON-able values (counters as plain dicts), its RSS growth included."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "rss_growth_mib": self.rss_growth_mib}

    def summary(self) -> str:
        classes = ", ".join(f"{k} {v}" for k, v in sorted(self.by_class.items()))
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items()))
        lines = [
            f"soak: {self.duration_s:.0f} s, {self.requests} requests ({self.requests / self.duration_s:.1f}/s), "
            f"{self.served} served",
            f"  by kind: {kinds}",
            f"  by class: {classes}",
            f"  latency of served requests: p50 {self.p50_s * 1000:.0f} ms, p99 {self.p99_s * 1000:.0f} ms",
            f"  server RSS: {self.rss_start_mib:.1f} MiB after warm-up, {self.rss_middle_mib:.1f} middle, "
            f"{self.rss_end_mib:.1f} end (growth {self.rss_growth_mib:+.2f} MiB)",
            f"  KV blocks all free at the end: {self.blocks_free_at_end}",
        ]
        lines += [f"  unexpected: {u}" for u in self.unexpected]
        return "\n".join(lines)


class _Client:
    """One load-generating thread's requests (each on its own connection)."""

    def __init__(self, port: int, config: SoakConfig, rng: random.Random, prefixes: list[str]):
        self.port, self.config, self.rng, self.prefixes = port, config, rng, prefixes

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def post(self, path: str, body: dict | bytes) -> tuple[int, dict | None]:
        conn = self.connection()
        try:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
            try:
                return response.status, json.loads(raw)
            except ValueError:
                return response.status, None
        finally:
            conn.close()

    def prompt(self) -> tuple[str, str]:
        tenant = self.rng.randrange(TENANTS)
        return f"{self.prefixes[tenant]}\nQuestion: {self.rng.choice(QUESTIONS)}\nAnswer:", f"tenant-{tenant}"

    def completion_body(self, **extra) -> dict:
        prompt, salt = self.prompt()
        return {"prompt": prompt, "cache_salt": salt, "max_tokens": self.rng.randint(2, self.config.max_tokens),
                "temperature": 0.7, "seed": self.rng.randrange(1000), **extra}

    def run(self, kind: str) -> list[tuple[str, float | None]]:
        """(class, latency of a served request or None) per request this kind sent."""
        if kind == "burst":
            return [self.simple("/v1/completions", {**self.completion_body(), "max_tokens": 1}) for _ in range(8)]
        if kind == "complete":
            return [self.simple("/v1/completions", self.completion_body())]
        if kind == "chat":
            prompt, salt = self.prompt()
            body = {"messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "Go on."}],
                    "cache_salt": salt, "max_tokens": self.config.max_tokens, "temperature": 0}
            return [self.simple("/v1/chat/completions", body)]
        if kind == "stream":
            return [self.stream(self.completion_body(stream=True), drop_after_first=False)]
        if kind == "cancel":
            return [self.stream(self.completion_body(stream=True, max_tokens=200, ignore_eos=True),
                                drop_after_first=True)]
        if kind == "bad":
            path, body, words = self.rng.choice(BAD_BODIES)
            status, answer = self.post(path, body)
            error = (answer or {}).get("error", {})
            if status == 400 and words in error.get("message", "") and set(error) >= {"message", "type", "code"}:
                return [("refused", None)]
            return [(f"unexpected: bad {path} got {status} {error.get('code')}: {error.get('message', '')[:80]}",
                     None)]
        if kind == "timeout":
            body = self.completion_body(max_tokens=400, ignore_eos=True, request_timeout=0.05)
            status, answer = self.post("/v1/completions", body)
            code = ((answer or {}).get("error") or {}).get("code")
            return [("timed_out", None) if status == 504 and code == "request_timeout"
                    else (f"unexpected: timeout got {status} {code}", None)]
        raise ValueError(f"unknown kind {kind!r}")

    def simple(self, path: str, body: dict) -> tuple[str, float | None]:
        started = time.monotonic()
        status, answer = self.post(path, body)
        elapsed = time.monotonic() - started
        if status == 200 and answer and answer.get("choices") and answer.get("usage"):
            return "served", elapsed
        return f"unexpected: {path} got {status} {json.dumps(answer)[:120]}", None

    def stream(self, body: dict, drop_after_first: bool) -> tuple[str, float | None]:
        started = time.monotonic()
        conn = self.connection()
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                return f"unexpected: stream got {response.status} {response.read()[:120]!r}", None
            events = []
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if drop_after_first:
                    return "cancelled", None  # the connection closes in `finally`: the server aborts it
            if events and events[-1] == "[DONE]" and not any('"error"' in e[:12] for e in events):
                return "served", time.monotonic() - started
            return f"unexpected: stream ended with {events[-2:]!r}", None
        finally:
            conn.close()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _metrics(port: int) -> dict[str, float]:
    """/metrics as {name{labels but model_name}: value}."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            labels = name.partition("{")[2].rstrip("}")
            kept = ",".join(p for p in labels.split(",") if p and not p.startswith("model_name="))
            values[name.partition("{")[0] + (f"{{{kept}}}" if kept else "")] = float(value)
    return values


def _idle(metrics: dict[str, float]) -> bool:
    usage = [v for k, v in metrics.items() if k.startswith("blockserve_kv_cache_usage_ratio")]
    busy = ("blockserve_num_requests_running", "blockserve_num_requests_waiting", "blockserve_queue_requests")
    return bool(usage) and not any(usage) and not any(metrics.get(name, 1) for name in busy)


def run_soak(port: int, pid: int, config: SoakConfig = SoakConfig()) -> SoakReport:
    """Load the server on 127.0.0.1:`port` (process `pid`, for its RSS) as described above."""
    rng = random.Random(config.seed)
    prefixes = [f"You are assistant number {t} of a team. " + " ".join(rng.choice(QUESTIONS) for _ in range(12))
                for t in range(TENANTS)]
    kinds, weights = list(MIX), list(MIX.values())
    started = time.monotonic()
    stop_at = started + config.duration_s
    lock = threading.Lock()
    report = SoakReport(config.duration_s)
    latencies: list[float] = []
    done = threading.Event()

    def client(index: int) -> None:
        own = random.Random(config.seed * 1000 + index)
        worker = _Client(port, config, own, prefixes)
        while time.monotonic() < stop_at:
            kind = own.choices(kinds, weights)[0]
            try:
                results = worker.run(kind)
            except (OSError, http.client.HTTPException) as e:
                results = [(f"unexpected: {kind} raised {type(e).__name__}: {e}", None)]
            with lock:
                report.by_kind[kind] += 1
                for outcome, latency in results:
                    report.requests += 1
                    cls = outcome.split(":")[0]
                    report.by_class[cls] += 1
                    if latency is not None:
                        report.served += 1
                        latencies.append(latency)
                    if cls == "unexpected" and len(report.unexpected) < 20:
                        report.unexpected.append(outcome)

    def sample_rss() -> None:
        while not done.wait(config.rss_every_s):
            report.rss_mib.append((time.monotonic() - started, _rss_mib(pid)))

    sampler = threading.Thread(target=sample_rss, name="soak-rss", daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(i,), name=f"soak-client-{i}", daemon=True)
               for i in range(config.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    deadline = time.monotonic() + 60
    while not _idle(metrics := _metrics(port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    done.set()
    sampler.join()
    report.rss_mib.append((time.monotonic() - started, _rss_mib(pid)))
    report.final_metrics = metrics
    report.blocks_free_at_end = _idle(metrics)
    report.p50_s, report.p99_s = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
    after_warmup = [(t, m) for t, m in report.rss_mib if t >= config.warmup_s] or report.rss_mib
    middle = config.warmup_s + (config.duration_s - config.warmup_s) / 2
    report.rss_start_mib = after_warmup[0][1]
    report.rss_middle_mib = min(after_warmup, key=lambda s: abs(s[0] - middle))[1]
    report.rss_end_mib = report.rss_mib[-1][1]
    return report


@contextlib.contextmanager
def serve(args: tuple[str, ...] = SERVE_ARGS, startup_timeout_s: float = 300):
    """A `blockserve serve` on a free loopback port: yields (port, process); SIGTERM at the end,
    which must drain and exit 0 (else RuntimeError with its log)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="blockserve-soak-", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, "-m", "blockserve.cli", "serve", "--port", str(port), *args],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"blockserve serve exited with {process.returncode}:\n"
                                   f"{Path(log.name).read_text()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"blockserve serve not healthy after {startup_timeout_s} s")
            time.sleep(0.25)
        yield port, process
        process.send_signal(signal.SIGTERM)
        if process.wait(timeout=60) != 0:
            raise RuntimeError(f"blockserve serve exited with {process.returncode} after SIGTERM:\n"
                               f"{Path(log.name).read_text()}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        log.close()
        os.unlink(log.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blockserve.sim.server_soak", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default: 30)")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before RSS growth is measured")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (each one request at a time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("serve_args", nargs="*", help=f"`blockserve serve` flags after -- (default: {SERVE_ARGS})")
    args = parser.parse_args(argv)
    config = SoakConfig(duration_s=args.minutes * 60, warmup_s=min(args.warmup, args.minutes * 30),
                        clients=args.clients, seed=args.seed)
    with serve(tuple(args.serve_args) or SERVE_ARGS) as (port, process):
        report = run_soak(port, process.pid, config)
    print(report.summary())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0 if report.by_class.get("unexpected", 0) == 0 and report.blocks_free_at_end else 1


if __name__ == "__main__":
    sys.exit(main())
