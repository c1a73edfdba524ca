"""Prometheus metrics for GET /metrics, in a registry of their own (no global state).

Engine state (requests running / waiting, KV usage per group, prefix-cache queries and hits,
preemptions) and the server's waiting queue are read at scrape time from the latest
SchedulerStats and QueueDepth the engine thread published; latencies, token counts and
rejections are observed as they happen.

    blockserve_num_requests_running / _waiting              gauge (the scheduler's; n > 1: one per sample)
    blockserve_queue_requests / _queue_prompt_tokens        gauge: accepted, no output yet (what
                                                            --max-waiting-requests / -tokens bound)
    blockserve_requests_rejected_total{reason}              counter, answered 503 (waiting_requests,
                                                            waiting_tokens, draining)
    blockserve_kv_cache_usage_ratio{group}                  gauge, 0..1, the target's KV cache groups
    blockserve_proposer_kv_cache_usage_ratio{group}         gauge, 0..1, a draft model's or MTP head's own
                                                            KV cache groups (only with one)
    blockserve_prefix_cache_queries_total / _hits_total     counter, prompt tokens
    blockserve_prefix_cache_state_lost_tokens_total         counter, prompt tokens cached as attention KV
                                                            that no recurrent-state checkpoint reached
    blockserve_prefix_cache_tier_hits_total                 counter, prompt tokens (of the hits) a second tier supplied
    blockserve_kv_tier_hits_total{tier} / _load_failures_total{tier}   counter, blocks read intact / failing their check
    blockserve_kv_tier_loaded_bytes_total{tier} / _load_seconds_total{tier} / _written_bytes_total{tier}  counter
    blockserve_kv_tier_writes_total{tier} / _write_failures_total{tier}  counter, blocks written / writes that failed
                                                            (writes and drops: every tensor-parallel rank's)
    blockserve_kv_tier_bytes{tier} / _entries{tier}         gauge, what the tier holds
    blockserve_kv_tier_writes_dropped_total / _writes_dropped_bytes_total  counter, saves the writer's queue had no room for
    blockserve_kv_tier_queue_bytes                          gauge, bytes waiting for the writer
    blockserve_num_preemptions_total                        counter
    blockserve_prompt_tokens_total / _generation_tokens_total  counter
    blockserve_request_finished_total{finished_reason}      counter (stop, length; abort: the client left;
                                                            timeout: past its deadline; stalled: the client
                                                            read nothing; error: its engine step failed)
    blockserve_time_to_first_token_seconds                  histogram
    blockserve_inter_token_latency_seconds                  histogram
    blockserve_e2e_request_latency_seconds                  histogram
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from blockserve.scheduler.output import SchedulerStats
from blockserve.server.engine_bridge.async_engine import QueueDepth

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], SchedulerStats], queue: Callable[[], QueueDepth], model_name: str):
        self._stats = stats
        self._queue = queue
        self._model = model_name

    def collect(self):
        s, q = self._stats(), self._queue()
        labels = ["model_name"]
        for name, doc, value in (
            ("blockserve_num_requests_running", "Requests in the running batch.", s.num_running),
            ("blockserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("blockserve_queue_requests", "Requests accepted and still waiting for their first output.", q.requests),
            ("blockserve_queue_prompt_tokens", "Prompt tokens of the requests still waiting for their first output.",
             q.prompt_tokens),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self._model], value)
            yield gauge
        usage = GaugeMetricFamily("blockserve_kv_cache_usage_ratio",
                                  "Fraction of a KV cache group's blocks held by requests (1 = full).",
                                  labels=["model_name", "group"])
        for group, value in enumerate(s.kv_usage):
            usage.add_metric([self._model, str(group)], value)
        yield usage
        if s.proposer_kv_usage is not None:
            proposer = GaugeMetricFamily("blockserve_proposer_kv_cache_usage_ratio",
                                         "Fraction of a KV cache group's blocks of the draft model or MTP head held "
                                         "(1 = full); its cache comes out of the same budget as the target's.",
                                         labels=["model_name", "group"])
            for group, value in enumerate(s.proposer_kv_usage):
                proposer.add_metric([self._model, str(group)], value)
            yield proposer
        for name, doc, value in (
            ("blockserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("blockserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("blockserve_prefix_cache_state_lost_tokens",
             "Prompt tokens whose attention KV was cached but that no recurrent-state checkpoint reached, "
             "so they were computed again.", s.prefix_cache_state_lost_tokens),
            ("blockserve_prefix_cache_tier_hits", "Prompt tokens of the prefix-cache hits that a second tier "
             "(host memory, disk) supplied.", s.prefix_cache_tier_hits),
            ("blockserve_num_preemptions", "Requests preempted to free KV cache.", s.num_preemptions),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric([self._model], value)
            yield counter
        if s.kv_offload is not None:
            yield from self._tier_metrics(s)
        spec = s.speculation
        if spec is None:
            return
        for name, doc, value in (
            ("blockserve_spec_decode_num_verifications", "Request-steps that scored draft tokens.",
             spec.num_verifications),
            ("blockserve_spec_decode_num_draft_tokens", "Draft tokens proposed and scored.", spec.num_draft_tokens),
            ("blockserve_spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
             spec.num_accepted_tokens),
            ("blockserve_spec_decode_proposer_seconds", "Seconds spent proposing drafts.", spec.proposer_seconds),
            ("blockserve_spec_decode_num_skipped", "Request-steps not speculated (large batch or low acceptance).",
             spec.num_skipped),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric([self._model], value)
            yield counter
        per_position = CounterMetricFamily("blockserve_spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each draft position.",
                                           labels=["model_name", "position"])
        for position, value in enumerate(spec.accepted_per_position):
            per_position.add_metric([self._model, str(position)], value)
        yield per_position

    def _tier_metrics(self, s: SchedulerStats):
        tier_labels = ["model_name", "tier"]
        for name, doc, family, read in (
            ("blockserve_kv_tier_hits", "Blocks a second tier served intact.", CounterMetricFamily,
             lambda t: t.hits),
            ("blockserve_kv_tier_load_failures", "Blocks a second tier listed but could not serve intact (missing, "
             "truncated or failing their checksum); they were computed again.", CounterMetricFamily,
             lambda t: t.load_failures),
            ("blockserve_kv_tier_loaded_bytes", "Bytes read from a second tier.", CounterMetricFamily,
             lambda t: t.bytes_loaded),
            ("blockserve_kv_tier_load_seconds", "Seconds spent reading and verifying a second tier's blocks.",
             CounterMetricFamily, lambda t: t.load_seconds),
            ("blockserve_kv_tier_writes", "Blocks written to a second tier (under tensor parallelism one entry per "
             "rank, every rank's counted, the other ranks' as they last reported, within about a second).",
             CounterMetricFamily, lambda t: t.writes),
            ("blockserve_kv_tier_written_bytes", "Bytes written to a second tier (every tensor-parallel rank's).",
             CounterMetricFamily, lambda t: t.bytes_written),
            ("blockserve_kv_tier_write_failures", "Writes to a second tier that failed (a full disk or a failing file "
             "system; they turn writes off), every tensor-parallel rank's.", CounterMetricFamily,
             lambda t: t.write_failures),
            ("blockserve_kv_tier_bytes", "Bytes a second tier holds.", GaugeMetricFamily, lambda t: t.bytes_held),
            ("blockserve_kv_tier_entries", "Blocks a second tier holds.", GaugeMetricFamily, lambda t: t.entries),
        ):
            metric = family(name, doc, labels=tier_labels)
            for tier in s.kv_offload.tiers:
                metric.add_metric([self._model, tier.name], read(tier))
            yield metric
        offload = s.kv_offload
        for name, doc, family, value in (
            ("blockserve_kv_tier_writes_dropped", "Blocks not saved to the second tier because its writer's queue "
             "had no room for them (every tensor-parallel rank's).", CounterMetricFamily, offload.writes_dropped),
            ("blockserve_kv_tier_writes_dropped_bytes", "Bytes of the blocks not saved because the writer's queue had "
             "no room for them (every tensor-parallel rank's).", CounterMetricFamily, offload.bytes_dropped),
            ("blockserve_kv_tier_queue_bytes", "Bytes of blocks waiting for the second tier's writer (rank 0's "
             "under tensor parallelism).", GaugeMetricFamily, offload.queued_bytes),
        ):
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric([self._model], value)
            yield metric


class Metrics:
    """Implements the AsyncEngine's Observer; `render()` is the /metrics body."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats], queue: Callable[[], QueueDepth]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, queue, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = histogram("blockserve_time_to_first_token_seconds",
                              "From the request's arrival to its first output token.", _TTFT_BUCKETS)
        self.itl = histogram("blockserve_inter_token_latency_seconds",
                             "Between two successive outputs of a request.", _ITL_BUCKETS)
        self.e2e = histogram("blockserve_e2e_request_latency_seconds",
                             "From the request's arrival to its end (finished or aborted).", _E2E_BUCKETS)
        self.prompt_tokens = counter("blockserve_prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("blockserve_generation_tokens", "Tokens generated.")
        self._finished = Counter("blockserve_request_finished", "Requests ended, by finish reason.",
                                 ["model_name", "finished_reason"], registry=self.registry)
        self._rejected = Counter("blockserve_requests_rejected", "Requests answered 503 before they started.",
                                 ["model_name", "reason"], registry=self.registry)
        self._model = model_name

    # -- Observer (the engine thread; on_rejected the event loop too; prometheus_client is thread-safe)

    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, inter_token: float | None, num_new_tokens: int) -> None:
        if inter_token is not None:
            self.itl.observe(inter_token)
        self.generation_tokens.inc(num_new_tokens)

    def on_finished(self, e2e: float, finish_reasons: list[str]) -> None:
        self.e2e.observe(e2e)
        for reason in finish_reasons:
            self._finished.labels(self._model, reason).inc()

    def on_rejected(self, reason: str) -> None:
        self._rejected.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
