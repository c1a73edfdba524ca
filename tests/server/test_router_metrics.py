"""The data-parallel front end's /metrics (data_parallel/metrics.py), from real replica metrics
(server/metrics.py's registry): each replica labelled, the totals summed (histograms bucket by
bucket, ratios averaged, start times the earliest), a dead replica's counters kept and its gauges
dropped, and the whole parsed back by prometheus_client as valid exposition text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from blockserve.data_parallel.metrics import ReplicaMetrics, merge, parse, render, router_families
from blockserve.scheduler.output import SchedulerStats
from blockserve.server.engine_bridge.async_engine import QueueDepth
from blockserve.server.engine_bridge.metrics import Metrics


def replica_text(running: int, usage: float, hits: int, ttfts: list[float], finished: list[str]) -> str:
    stats = SchedulerStats(num_running=running, num_waiting=0, kv_usage=[usage], prefix_cache_queries=2 * hits,
                           prefix_cache_hits=hits, prefix_cache_state_lost_tokens=0, num_preemptions=0,
                           num_scheduled_tokens=0)
    metrics = Metrics('m "quoted"', lambda: stats, lambda: QueueDepth(requests=running, prompt_tokens=10 * running))
    for ttft in ttfts:
        metrics.on_first_token(ttft, num_prompt_tokens=5)
    metrics.on_finished(1.0, finished)
    return metrics.render().decode()


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, for every sample of a parsed exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(parsed: dict, name: str, replica: str, **labels) -> float:
    wanted = {"replica": replica, "model_name": 'm "quoted"', **labels}
    return parsed[(name, tuple(sorted(wanted.items())))]


TEXTS = [replica_text(2, 0.5, 8, [0.02, 0.3], ["stop", "length"]),
         replica_text(1, 0.25, 4, [0.3], ["abort"])]


def test_each_replica_labelled_and_the_totals_summed():
    replicas = [ReplicaMetrics(parse(text), alive=True, scraped=True) for text in TEXTS]
    text = render([*merge(replicas), *router_families({"affinity": 3, "load": 1}, [(0, True, True, 2),
                                                                                  (1, True, True, 0)])]).decode()
    parsed = samples(text)  # parses: valid exposition, quotes in label values escaped
    hits = "blockserve_prefix_cache_hits_total"
    assert [value(parsed, hits, r) for r in ("0", "1", "total")] == [8, 4, 12]
    running = "blockserve_num_requests_running"
    assert [value(parsed, running, r) for r in ("0", "1", "total")] == [2, 1, 3]
    assert value(parsed, "blockserve_kv_cache_usage_ratio", "total", group="0") == 0.375  # averaged, not summed
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1)):
        assert value(parsed, "blockserve_request_finished_total", "total", finished_reason=reason) == count
    bucket = "blockserve_time_to_first_token_seconds_bucket"
    assert value(parsed, bucket, "0", le="0.025") == 1 and value(parsed, bucket, "1", le="0.025") == 0
    assert value(parsed, bucket, "total", le="0.025") == 1 and value(parsed, bucket, "total", le="0.5") == 3
    assert value(parsed, "blockserve_time_to_first_token_seconds_count", "total") == 3
    assert abs(value(parsed, "blockserve_time_to_first_token_seconds_sum", "total") - 0.62) < 1e-9
    created = "blockserve_prompt_tokens_created"
    assert value(parsed, created, "total") == min(value(parsed, created, r) for r in ("0", "1"))
    assert parsed[("blockserve_router_requests_total", (("reason", "affinity"),))] == 3
    assert parsed[("blockserve_router_replica_up", (("replica", "1"),))] == 1
    assert parsed[("blockserve_router_in_flight", (("replica", "0"),))] == 2
    assert text.count("# TYPE blockserve_prefix_cache_hits_total counter") == 1  # one family, not one per replica


def test_a_dead_replica_keeps_its_counters_in_the_totals_and_loses_its_gauges():
    dead = ReplicaMetrics(parse(TEXTS[1]), alive=False, scraped=False)
    replicas = [ReplicaMetrics(parse(TEXTS[0]), alive=True, scraped=True), dead, None]  # replica 2: never scraped
    text = render([*merge(replicas), *router_families({}, [(0, True, True, 0), (1, False, False, 0),
                                                           (2, True, False, 0)])]).decode()
    parsed = samples(text)
    hits = "blockserve_prefix_cache_hits_total"
    assert value(parsed, hits, "1") == 4 and value(parsed, hits, "total") == 12  # what it served stays counted
    assert value(parsed, "blockserve_time_to_first_token_seconds_count", "total") == 3
    running = "blockserve_num_requests_running"
    assert value(parsed, running, "total") == 2 and (running, (("model_name", 'm "quoted"'), ("replica", "1"))) \
        not in parsed  # it runs nothing now
    assert parsed[("blockserve_router_replica_up", (("replica", "1"),))] == 0
    assert parsed[("blockserve_router_replica_scraped", (("replica", "1"),))] == 0
    assert parsed[("blockserve_router_replica_scraped", (("replica", "2"),))] == 0
    assert not any(("replica", "2") in labels for name, labels in parsed if not name.startswith("blockserve_router"))
