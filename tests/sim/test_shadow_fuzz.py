"""Random arrival streams through the real scheduler and KV manager, checked by the shadow runner.

Every read and write is checked (C1, C4), `check_integrity()` runs after every step (C3), every
stream finishes (C5), and outputs equal those of the same stream with prefix caching off (C4).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockserve.sampling_params import SamplingParams
from blockserve.scheduler import Request, SchedulerConfig
from blockserve.sim import ShadowViolation
from blockserve.sim.drive import Arrival, build, run_stream
from tests.sim.conftest import LAYOUTS, kv_config

MAX_MODEL_LEN = 40


@st.composite
def streams(draw):
    prefixes = [draw(st.lists(st.integers(0, 50), min_size=1, max_size=14)) for _ in range(3)]
    specs = []
    for i in range(draw(st.integers(1, 24))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 50), max_size=10))
        specs.append(
            dict(
                rid=f"r{i}",
                prompt=prompt or [1],
                max_tokens=draw(st.integers(1, 16)),
                salt=draw(st.sampled_from([None, "tenant-a"])),
                priority=draw(st.integers(0, 2)),
                step=draw(st.integers(0, 12)),
                abort=draw(st.none() | st.integers(0, 30)),
            )
        )
    return specs


def arrivals(specs) -> list[Arrival]:
    return sorted([
        Arrival(
            s["step"],
            Request(s["rid"], s["prompt"], SamplingParams(max_tokens=s["max_tokens"], ignore_eos=True),
                    arrival_time=float(i), priority=s["priority"], cache_salt=s["salt"]),
            s["abort"],
        )
        for i, s in enumerate(specs)
    ], key=lambda a: a.step)


def run(layout, specs, num_blocks, prefix_caching, policy, budget, chunk):
    sched_config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=6, max_num_batched_tokens=budget, max_prefill_chunk=chunk, policy=policy
    )
    scheduler, runner = build(kv_config(layout, num_blocks, prefix_caching), sched_config, LAYOUTS[layout][1])
    result = run_stream(scheduler, runner, arrivals(specs), max_steps=5000)
    scheduler.assert_idle()
    return result


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=streams(),
    num_blocks=st.integers(11, 24),
    policy=st.sampled_from(["fcfs", "priority"]),
    budget=st.integers(4, 32),
    chunk=st.none() | st.integers(1, 8),
)
def test_random_streams_are_correct_and_caching_never_changes_the_answer(layout, specs, num_blocks, policy, budget, chunk):
    on = run(layout, specs, num_blocks, True, policy, budget, chunk)
    off = run(layout, specs, num_blocks, False, policy, budget, chunk)
    assert on.rejected.keys() == off.rejected.keys()
    for rid in on.tokens.keys() | off.tokens.keys():
        a, b = on.tokens.get(rid, []), off.tokens.get(rid, [])
        if "abort" in (on.finish_reasons.get(rid), off.finish_reasons.get(rid)):
            shorter = min(len(a), len(b))  # aborted at the same step, but maybe at another point
            assert a[:shorter] == b[:shorter], rid
        else:
            assert a == b, rid
    assert off.prefix_hits == 0


def _recycling_stream(n: int = 16) -> list[Arrival]:
    """Distinct prompts of odd lengths, so freed blocks return to new requests with stale tails."""
    return [
        Arrival(i // 2, Request(f"r{i}", [i * 7 + j for j in range(9 + i % 5)], SamplingParams(max_tokens=3, ignore_eos=True)))
        for i in range(n)
    ]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_disabling_zeroing_is_caught_when_a_backend_reads_unwritten_slots(layout):
    """The simulator can fail: with the derived zero flags forced off, recycled blocks (or state
    slots) are read before being written."""
    sched_config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=32)
    scheduler, runner = build(kv_config(layout, 12, zeroing=False), sched_config, LAYOUTS[layout][1])
    with pytest.raises(ShadowViolation, match="not zeroed|expected 'zero'"):
        run_stream(scheduler, runner, _recycling_stream())
    scheduler, runner = build(kv_config(layout, 12, zeroing=True), sched_config, LAYOUTS[layout][1])
    run_stream(scheduler, runner, _recycling_stream())
    scheduler.assert_idle()
