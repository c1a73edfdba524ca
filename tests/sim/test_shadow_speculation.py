"""Speculative decoding through the real scheduler and KV manager, checked by the shadow runner.

The shadow proposer's drafts are partly right and partly wrong; the runner writes every draft's slots
as the content it claims and marks rejected ones. So a rejected draft reported computed, read as KV
or cached (C4), or a block table that disagrees after a rollback, fails the run; and the tokens must
equal those of the same stream without speculation, with prefix caching on or off. With a state
group the slot is rolled back to the last kept token, and a state checkpoint captured after a
rejected draft must never be cached (its first restore would fail).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockserve.scheduler import SchedulerConfig
from blockserve.scheduler.scheduler import Scheduler
from blockserve.kv import KVCacheManager
from blockserve.sim import ShadowViolation
from blockserve.sim.drive import build, run_stream
from blockserve.sim.shadow_runner import shadow_continuation
from blockserve.spec_decode.config import SpeculativeConfig
from tests.sim.conftest import LAYOUTS, kv_config
from tests.sim.test_shadow_fuzz import MAX_MODEL_LEN, arrivals, streams



def run(layout, specs, num_blocks, prefix_caching, budget, chunk, k=None, poison=False, check=True):
    sched_config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=6, max_num_batched_tokens=budget,
                                   max_prefill_chunk=chunk)
    speculative = None if k is None else SpeculativeConfig(num_speculative_tokens=k)
    scheduler, runner = build(kv_config(layout, num_blocks, prefix_caching, poison=poison), sched_config,
                              LAYOUTS[layout][1], speculative=speculative)
    result = run_stream(scheduler, runner, arrivals(specs), check=check, max_steps=5000)
    scheduler.assert_idle()
    return result


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=streams(), num_blocks=st.integers(11, 24), budget=st.integers(4, 32), chunk=st.none() | st.integers(1, 8),
       k=st.integers(1, 5), caching=st.booleans(), poison=st.booleans())
def test_speculation_never_changes_the_tokens_nor_caches_a_rejected_draft(layout, specs, num_blocks, budget, chunk,
                                                                          k, caching, poison):
    spec = run(layout, specs, num_blocks, caching, budget, chunk, k, poison)
    plain = run(layout, specs, num_blocks, False, budget, chunk)
    assert spec.rejected.keys() == plain.rejected.keys()
    for rid in spec.tokens.keys() | plain.tokens.keys():
        a, b = spec.tokens.get(rid, []), plain.tokens.get(rid, [])
        if "abort" in (spec.finish_reasons.get(rid), plain.finish_reasons.get(rid)):
            shorter = min(len(a), len(b))  # aborted at the same step, but speculation ran ahead
            assert a[:shorter] == b[:shorter], rid
        else:
            assert a == b, rid


def test_a_stream_speculates_rejects_and_hits():
    """The fuzz above is not trivially true: drafts are proposed, some rejected, and prefixes hit."""
    specs = [dict(rid=f"r{i}", prompt=[5, 6, 7, 8, 9, 10, 11, 12, 13] + [i], max_tokens=10, salt=None, priority=0,
                  step=2 * i, abort=None) for i in range(6)]
    result = run("full", specs, 24, True, 16, None, k=3, poison=True)
    assert result.draft_tokens > 20 and 0 < result.rejected_drafts < result.draft_tokens
    assert result.prefix_hits > 0
    assert all(len(t) == 10 for t in result.tokens.values())


def test_a_hybrid_stream_rolls_back_state_and_restores_checkpoints():
    """State checkpoints are captured while drafts are verified (stride 4: most verifications cross one),
    some after rejected drafts; the ones kept are restored by later requests sharing the replies."""
    specs = [dict(rid=f"r{i}", prompt=[5, 6, 7, 8, 9, 10, 11, 12, 13] + [i % 2], max_tokens=12, salt=None,
                  priority=0, step=3 * i, abort=None) for i in range(8)]
    result = run("mla+state", specs, 40, True, 16, None, k=3, poison=True)
    assert result.draft_tokens > 20 and 0 < result.rejected_drafts < result.draft_tokens
    assert result.state_captures > 0 and result.prefix_hits > 0


def test_a_checkpoint_captured_after_a_rejected_draft_is_caught(monkeypatch):
    """The simulator can fail: a state manager that keeps a decode-time capture that followed a rejected
    draft caches it once the request gets that far (as its reply's last checkpoint, at 20), and a later
    request whose prompt is the first's prompt and reply restores a state no sequence has."""
    from blockserve.kv.state_manager import LinearStateManager

    first = [[5, 6, 7, 8, 9, 10, 11, i] for i in range(2)]
    prompts = first + [p + shadow_continuation(p, 14)[:12] + [99] for p in first]
    specs = [dict(rid=f"r{i}", prompt=p, max_tokens=14, salt=None, priority=0, step=0 if i < 2 else 60, abort=None)
             for i, p in enumerate(prompts)]
    result = run("mla+state", specs, 48, True, 16, None, k=3)  # correct as it is
    assert result.rejected_drafts > 0 and result.prefix_hits > 0
    monkeypatch.setattr(LinearStateManager, "drop_captures", lambda self, request_id, num_tokens: None)
    with pytest.raises(ShadowViolation, match="state slot"):
        run("mla+state", specs, 48, True, 16, None, k=3, check=False)  # the integrity check would stop it first


def test_blocks_kept_after_a_rejection_are_caught(monkeypatch):
    """The simulator can fail: a KV manager that keeps the blocks holding only rejected drafts disagrees
    with the worker's table, which drops them, so the next step's KV goes where it is not read."""
    specs = [dict(rid="r0", prompt=[5, 6, 7, 8, 9], max_tokens=30, salt=None, priority=0, step=0, abort=None)]
    run("full", specs, 32, True, 16, None, k=5)  # correct as it is
    monkeypatch.setattr(KVCacheManager, "trim_slots", lambda self, request, num_tokens: None)
    with pytest.raises(ShadowViolation):
        run("full", specs, 32, True, 16, None, k=5)
