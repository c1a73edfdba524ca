"""/metrics exports the acceptance statistics, per draft position too."""

from __future__ import annotations

from blockserve.scheduler.output import SchedulerStats
from blockserve.server.engine_bridge.async_engine import QueueDepth
from blockserve.server.engine_bridge.metrics import Metrics
from blockserve.spec_decode.stats import SpeculationStats


def test_speculation_counters_are_exported():
    spec = SpeculationStats(2, 8, 5, (2, 2, 2, 2), (2, 2, 1, 0), 0.01, 1)
    stats = SchedulerStats(1, 0, [0.1], 0, 0, 0, 0, 0, speculation=spec)
    body = Metrics("m", lambda: stats, lambda: QueueDepth(0, 0)).render().decode()
    assert 'blockserve_spec_decode_num_draft_tokens_total{model_name="m"} 8.0' in body
    assert 'blockserve_spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in body
    assert 'blockserve_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in body
    plain = Metrics("m", lambda: SchedulerStats(1, 0, [0.1], 0, 0, 0, 0, 0), lambda: QueueDepth(0, 0))
    assert "spec_decode" not in plain.render().decode()
