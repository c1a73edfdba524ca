"""C2 in the default run: 10k max_tokens=1 requests, every buffer drained after every step."""

from __future__ import annotations

import pytest

from blockserve.kv.group_managers import FullAttentionManager
from blockserve.sim.soak import soak

pytestmark = pytest.mark.slow  # a soak


def test_ten_thousand_short_requests_leave_nothing_behind():
    report = soak(10_000)
    assert report.num_requests == 10_000
    assert report.traced_growth < 2**20, str(report)
    assert report.rss_growth < 2**20, str(report)


def test_the_soak_catches_a_manager_that_forgets_to_drop_a_finished_request(monkeypatch):
    """The check can fail: a free() that keeps the request's cache count is a per-request leak."""
    original = FullAttentionManager.free

    def leaky_free(self, request_id):
        cached = self.num_cached.get(request_id)
        original(self, request_id)
        if cached is not None:
            self.num_cached[request_id] = cached

    monkeypatch.setattr(FullAttentionManager, "free", leaky_free)
    with pytest.raises(AssertionError, match="cache counts of a finished request"):
        soak(200, warmup=100)


def test_a_hybrid_model_with_state_checkpoints_leaves_nothing_behind():
    """The same C2 soak over attention + recurrent state: captures, restores and evictions of
    checkpoints every step, and still nothing accumulates."""
    report = soak(5_000, warmup=1000, hybrid=True)
    assert report.checkpoint_restores > 1000, str(report)
    assert report.traced_growth < 2**20, str(report)
    assert report.rss_growth < 2**20, str(report)
