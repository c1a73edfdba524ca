"""/metrics reports a draft model's or MTP head's own KV cache apart from the target's
(`blockserve_proposer_kv_cache_usage_ratio{group}`), and only for an engine that has one."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from blockserve.scheduler.output import SchedulerStats
from blockserve.server.engine_bridge.async_engine import QueueDepth
from blockserve.server.engine_bridge.metrics import Metrics


def gauges(proposer_kv_usage: list[float] | None) -> dict[tuple[str, str], float]:
    """(metric, group) -> value of the KV usage gauges an engine with these stats exposes."""
    stats = SchedulerStats(num_running=1, num_waiting=0, kv_usage=[0.5], prefix_cache_queries=0,
                           prefix_cache_hits=0, prefix_cache_state_lost_tokens=0, num_preemptions=0,
                           num_scheduled_tokens=0, proposer_kv_usage=proposer_kv_usage)
    text = Metrics("m", lambda: stats, lambda: QueueDepth(requests=0, prompt_tokens=0)).render().decode()
    return {(s.name, s.labels["group"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.endswith("kv_cache_usage_ratio")}


def test_the_proposer_s_kv_usage_is_a_gauge_of_its_own_per_group():
    assert gauges([0.25, 0.75]) == {("blockserve_kv_cache_usage_ratio", "0"): 0.5,
                                    ("blockserve_proposer_kv_cache_usage_ratio", "0"): 0.25,
                                    ("blockserve_proposer_kv_cache_usage_ratio", "1"): 0.75}


def test_an_engine_without_a_proposer_cache_exposes_no_proposer_gauge():
    assert gauges(None) == {("blockserve_kv_cache_usage_ratio", "0"): 0.5}
