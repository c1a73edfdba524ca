"""The soak's 40-second version (`make soak-server` runs it for 30): mixed load against a real
`blockserve serve` with the bundled model (blockserve/sim/server_soak.py). No unexpected answer, the
server's RSS grows by less than 5 MB after the warm-up, every KV block is free at the end, and
SIGTERM then drains and exits 0."""

from __future__ import annotations

import pytest

from blockserve.sim.server_soak import MIX, SoakConfig, run_soak, serve

pytestmark = pytest.mark.slow  # a soak: 40 s against a `blockserve serve` process


def test_forty_seconds_of_mixed_load_leave_nothing_behind():
    with serve() as (port, process):
        report = run_soak(port, process.pid, SoakConfig(duration_s=40, warmup_s=15))
    print(report.summary())
    assert report.by_class["unexpected"] == 0, report.unexpected
    assert set(report.by_kind) == set(MIX), report.by_kind  # every kind of load ran
    assert report.served >= 50 and report.by_class["cancelled"] and report.by_class["timed_out"], report.summary()
    assert report.rss_growth_mib < 5, report.rss_mib
    assert report.blocks_free_at_end, report.final_metrics
