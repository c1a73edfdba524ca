"""The scheduler's behaviour: admission order, budgets, chunked prefill, prefix hits, preemption,
block tables, stop conditions, C2 (idle), C4 (caching after the KV is written), C5 (admission)
and abort. The `Driver` (conftest) checks every step's output; tests assert their scenario."""

from __future__ import annotations

import random

import pytest

from blockserve.sampling_params import SamplingParams
from blockserve.scheduler import Request, RequestRejected, RequestStatus

from .conftest import BLOCK, Driver, kv_config, scripted, tight_config, tokens

LAYOUTS = ["full", "full+sliding", "full+state"]


def scheduled(driver: Driver, steps: int) -> list[dict[str, int]]:
    """Tokens scheduled per request over the next `steps` steps."""
    return [dict(driver.step()[0].num_scheduled_tokens) for _ in range(steps)]


# -- admission order -------------------------------------------------------------------------------


def test_fcfs_admits_in_arrival_order():
    d = Driver(kv_config(), max_num_seqs=2)
    for i, rid in enumerate("abcde"):
        d.add(rid, tokens(5, start=10 * i), max_tokens=2 + i)
    d.run()
    assert d.admitted == list("abcde")


@pytest.mark.parametrize("arrivals", ["in order added", "all equal"])
def test_priority_admits_by_priority_then_arrival(arrivals):
    d = Driver(kv_config(), max_num_seqs=1, policy="priority")
    for i, (rid, priority) in enumerate(zip("abcde", [2, 0, 1, 0, 2])):
        d.add(rid, tokens(5, start=10 * i), priority=priority, arrival=0.0 if arrivals == "all equal" else None)
    d.run()
    assert d.admitted == list("bdcae")


def test_priority_ties_break_by_arrival_time_not_insertion():
    d = Driver(kv_config(), max_num_seqs=1, policy="priority")
    d.add("late", tokens(5), arrival=5.0)
    d.add("early", tokens(5, start=20), arrival=1.0)
    d.run()
    assert d.admitted == ["early", "late"]


# -- budgets and chunked prefill -------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunked", [True, False])
def test_token_budget_and_max_num_seqs_hold_every_step(layout, chunked):
    budget = 16 if chunked else 32
    d = Driver(kv_config(layout), max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=32,
               enable_chunked_prefill=chunked)
    rng = random.Random(1)
    for i in range(24):
        d.add(f"r{i}", [rng.randrange(100) for _ in range(rng.randrange(3, 21))], max_tokens=rng.randrange(1, 9))
    d.run()  # the driver asserts both limits after every schedule()
    assert len(d.finished) == 24
    totals = [out.total_num_scheduled_tokens for out, _, _ in d.history]
    batch_sizes = [len(out.num_scheduled_tokens) for out, _, _ in d.history]
    assert max(batch_sizes) == 4  # the limits were binding, so the test could fail
    assert (max(totals) == budget) if chunked else (max(totals) > budget // 2)


def test_long_prompt_is_chunked_and_batched_with_decodes():
    d = Driver(kv_config(), max_num_batched_tokens=16)
    d.add("short", tokens(3), max_tokens=10)
    assert scheduled(d, 1) == [{"short": 3}]
    d.add("long", tokens(40, start=100), max_tokens=2)
    steps = [d.step() for _ in range(4)]
    assert [dict(out.num_scheduled_tokens) for out, _, _ in steps] == [
        {"short": 1, "long": 15},
        {"short": 1, "long": 15},
        {"short": 1, "long": 10},
        {"short": 1, "long": 1},
    ]
    first_token_step = [any(o.request_id == "long" for o in outputs) for _, outputs, _ in steps]
    assert first_token_step == [False, False, True, True]  # sampled only once the whole prompt is in


def test_max_prefill_chunk_caps_each_request():
    d = Driver(kv_config(), max_num_batched_tokens=64, max_prefill_chunk=8)
    d.add("a", tokens(20), max_tokens=2)
    d.add("b", tokens(20, start=100), max_tokens=2)
    assert scheduled(d, 4) == [{"a": 8, "b": 8}, {"a": 8, "b": 8}, {"a": 4, "b": 4}, {"a": 1, "b": 1}]


@pytest.mark.parametrize("chunked", [True, False])
def test_without_chunked_prefill_a_prompt_is_scheduled_whole(chunked):
    d = Driver(kv_config(), max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=chunked)
    d.add("a", tokens(20), max_tokens=4)
    d.add("b", tokens(20, start=100), max_tokens=4)
    expected = [{"a": 20, "b": 12}, {"a": 1, "b": 8}] if chunked else [{"a": 20}, {"a": 1, "b": 20}]
    assert scheduled(d, 2) == expected


# -- prefix caching --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, hit", [("full", 12), ("full+sliding", 12), ("full+state", 0)])
def test_prefix_hit_on_admission(layout, hit):
    d = Driver(kv_config(layout))
    prefix = tokens(12)
    d.add("first", prefix + [50, 51], max_tokens=2)
    d.run()
    d.add("second", prefix + [60, 61, 62], max_tokens=2)
    out, outputs, stats = d.step()
    (new,) = out.new_requests
    assert new.num_computed_tokens == hit
    assert out.num_scheduled_tokens == {"second": 15 - hit}
    assert outputs[0].num_cached_tokens == hit
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == ((14 + 15, hit) if hit else (0, 0))
    d.run()
    assert d.finished["second"].num_cached_tokens == hit


@pytest.mark.parametrize("prompt_len, hit", [(16, 12), (5, 4), (4, 0)])
def test_a_hit_always_leaves_a_token_to_compute(prompt_len, hit):
    d = Driver(kv_config())
    d.add("first", tokens(prompt_len), max_tokens=1)
    d.run()
    d.add("again", tokens(prompt_len), max_tokens=1)
    out = d.step()[0]
    assert out.new_requests[0].num_computed_tokens == hit
    assert out.num_scheduled_tokens == {"again": prompt_len - hit}
    assert d.finished["again"].finish_reason == "length"  # it sampled, so its last token was computed


@pytest.mark.parametrize("caching, salt, hit", [(True, "tenant-a", 8), (True, "tenant-b", 0), (False, "tenant-a", 0)])
def test_hits_need_caching_on_and_the_same_salt(caching, salt, hit):
    d = Driver(kv_config(caching=caching))
    d.add("first", tokens(12), salt="tenant-a", max_tokens=1)
    d.run()
    d.add("second", tokens(12), salt=salt, max_tokens=1)
    assert d.step()[0].new_requests[0].num_computed_tokens == hit


# -- C4: caching only after the KV is written ------------------------------------------------------


@pytest.mark.parametrize("layout", ["full", "full+sliding"])
def test_blocks_enter_the_prefix_cache_only_after_update(layout):
    d = Driver(kv_config(layout))
    d.add("a", tokens(12), max_tokens=3)
    d.add("twin", tokens(12), max_tokens=3)  # admitted in the same step: a's KV is not written yet
    out = d.schedule()
    assert [r.num_computed_tokens for r in out.new_requests] == [0, 0]
    assert d.cached_hashes() == set()
    d.update(out)
    assert len(d.cached_hashes()) == 3
    d.add("later", tokens(12), max_tokens=3)
    assert d.step()[0].new_requests[0].num_computed_tokens == 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_abort_between_schedule_and_update_discards_the_step(layout):
    d = Driver(kv_config(layout))
    d.add("a", tokens(12), max_tokens=3)
    d.add("b", tokens(8, start=100), max_tokens=3)
    out = d.schedule()
    assert d.abort(["a"]) == ["a"]
    assert d.in_use()[0] == 2  # only b's blocks are left
    outputs, _ = d.update(out)
    assert [o.request_id for o in outputs] == ["b"]
    assert "a" in d.step()[0].finished_request_ids
    d.add("a2", tokens(12), max_tokens=3)
    d.add("b2", tokens(8, start=100), max_tokens=3)
    d.run()
    b_hit = 0 if layout == "full+state" else 4  # so a hit was possible: a's absence is C4's doing
    assert (d.finished["a2"].num_cached_tokens, d.finished["b2"].num_cached_tokens) == (0, b_hit)


def test_a_preempted_prefill_leaves_only_the_chunks_already_computed():
    d = Driver(kv_config(num_blocks=8), max_num_batched_tokens=8)
    d.add("head", tokens(4), max_tokens=20)
    d.add("victim", tokens(24, start=100), max_tokens=2)
    for _ in range(10):
        if d.step()[0].preempted_request_ids:
            break
    assert d.history[-1][0].preempted_request_ids == {"victim"}
    computed_chunks = sum(out.num_scheduled_tokens.get("victim", 0) for out, _, _ in d.history[:-1])
    assert 0 < computed_chunks < 24
    d.abort(["head", "victim"])
    d.add("probe", tokens(24, start=100), max_tokens=1)
    assert d.step()[0].new_requests[0].num_computed_tokens == computed_chunks // BLOCK * BLOCK


# -- preemption ------------------------------------------------------------------------------------


def three_decoders(policy: str, priorities=(0, 0, 0, 0), arrival: float | None = None) -> Driver:
    """a, b, c each hold one of 4 blocks after their first step, and d waits (max_num_seqs=3):
    the next step needs 3 more blocks, so one of a, b, c must be preempted."""
    d = Driver(kv_config(num_blocks=5, caching=False), max_num_seqs=3, policy=policy)
    for i, (rid, priority) in enumerate(zip("abcd", priorities)):
        d.add(rid, tokens(4, start=10 * i), priority=priority, arrival=arrival, max_tokens=4)
    d.step()
    assert d.in_use() == [3] and d.waiting_ids() == ["d"]
    return d


@pytest.mark.parametrize("policy, priorities, victim", [
    ("fcfs", (0, 0, 0, 0), "c"),
    ("priority", (0, 0, 0, 5), "c"),
    ("priority", (0, 1, 0, 5), "b"),  # lowest priority first, although c arrived later
    ("priority", (1, 0, 0, 5), "a"),
])
def test_preemption_victim_is_the_lowest_priority_latest_arrival(policy, priorities, victim):
    d = three_decoders(policy, priorities)
    out, _, stats = d.step()
    assert out.preempted_request_ids == {victim}
    assert set(out.num_scheduled_tokens) == set("abc") - {victim}
    assert not out.new_requests  # nobody is admitted in a step that preempts
    assert d.scheduler.waiting.peek().request_id == victim
    assert stats.num_preemptions == 1 and d.scheduler.requests[victim].num_preemptions == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("arrival", [None, 0.0], ids=["distinct arrivals", "equal arrivals"])
def test_preempted_request_returns_to_the_front_and_is_readmitted_first(policy, arrival):
    d = three_decoders(policy, arrival=arrival)
    assert d.step()[0].preempted_request_ids == {"c"}
    assert d.waiting_ids() == ["c", "d"]
    d.run()
    assert d.admitted == ["a", "b", "c", "c", "d"]
    assert len(d.tokens["c"]) == 4


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_request_frees_everything_and_is_recomputed(caching):
    d = Driver(kv_config(num_blocks=7, caching=caching))  # 6 blocks
    d.add("a", tokens(8), max_tokens=4)
    d.add("b", tokens(12, start=100), max_tokens=4)
    d.step()
    assert d.in_use() == [5]
    out, _, stats = d.step()  # a takes the last block; b needs a fourth and preempts itself
    assert out.preempted_request_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert d.in_use() == [3] and stats.kv_usage == [0.5]
    d.run()
    (readmission,) = [out for out, _, _ in d.history[2:] if any(r.request_id == "b" for r in out.new_requests)]
    # Its prompt and first output token are recomputed, or found in the blocks it cached before.
    assert readmission.num_scheduled_tokens["b"] == (1 if caching else 13)
    assert len(d.tokens["b"]) == 4 and d.finished["b"].finish_reason == "length"
    assert d.finished["b"].num_cached_tokens == 0  # the hit at its first admission


# -- no livelock (C5) ------------------------------------------------------------------------------


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [True, False])
def test_many_long_requests_on_a_tiny_cache_all_finish(layout, policy, caching, ahead):
    rng = random.Random(7)
    chunk = 8
    d = Driver(tight_config(layout, 40, chunk, caching=caching), max_num_batched_tokens=chunk, policy=policy,
               ahead=ahead)
    total = 0
    shared = tokens(8, start=500)
    for i in range(12):
        prefix = shared if rng.random() < 0.5 else []
        prompt = prefix + [rng.randrange(100) for _ in range(rng.randrange(16, 31) - len(prefix))]
        max_tokens = rng.randrange(4, 41 - len(prompt))
        d.add(f"r{i}", prompt, priority=rng.randrange(3), max_tokens=max_tokens)
        total += len(prompt) + max_tokens
    d.run(max_steps=total + 1)  # the oldest running request computes at least one token every step
    assert {rid: o.finish_reason for rid, o in d.finished.items()} == {f"r{i}": "length" for i in range(12)}
    assert d.num_preemptions > 0  # the case was adversarial


# -- block tables ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_new_requests_get_whole_tables_and_continuing_ones_only_appended_ids(layout):
    d = Driver(kv_config(layout))
    d.add("first", tokens(12), max_tokens=1)
    d.run()
    d.add("a", tokens(13), max_tokens=9)
    (new,) = d.step()[0].new_requests
    assert new.block_ids == d.kv.block_ids("a")  # the whole table, prefix-hit blocks included
    assert len(new.block_ids[0]) == 4 and new.num_computed_tokens == (0 if layout == "full+state" else 12)
    appended = []
    for _ in range(8):
        before = [len(ids) for ids in d.kv.block_ids("a")]
        out = d.schedule()
        (cached,) = out.cached_requests
        assert [list(ids) for ids in cached.new_block_ids] == [ids[n:] for ids, n in zip(d.kv.block_ids("a"), before)]
        appended.append(len(cached.new_block_ids[0]))
        d.update(out)
    assert appended == [0, 0, 0, 1, 0, 0, 0, 1]  # the full group gains a block every 4 tokens


# -- stop conditions -------------------------------------------------------------------------------

EOS, STOP = 7, 42


def finish(script: list[int], **sampling):
    """Run one request whose outputs follow `script`; return its tokens and final output (which
    async scheduling must not change: checked here)."""
    results = []
    for ahead in (False, True):
        d = Driver(kv_config(), scripted({"r": script}), ahead=ahead)
        d.add("r", tokens(5, start=100), eos=EOS, **sampling)
        d.run()
        results.append((d.tokens["r"], d.finished["r"]))
    assert results[0] == results[1], "async scheduling changed the output"
    return results[0]


def test_max_tokens_ends_with_length():
    out_tokens, last = finish([], max_tokens=5)
    assert len(out_tokens) == 5 and last.finish_reason == "length"


@pytest.mark.parametrize("ignore_eos, expected, reason", [
    (False, [5, 6, EOS], "stop"),
    (True, [5, 6, EOS, 8, 9], "length"),
])
def test_eos_stops_unless_ignored(ignore_eos, expected, reason):
    out_tokens, last = finish([5, 6, EOS, 8, 9], max_tokens=5, ignore_eos=ignore_eos)
    assert (out_tokens, last.finish_reason, last.stop_reason) == (expected, reason, None)


def test_stop_token_ids_stop_and_set_stop_reason():
    out_tokens, last = finish([5, STOP, 6], max_tokens=5, stop_token_ids=[STOP])
    assert (out_tokens, last.finish_reason, last.stop_reason) == ([5, STOP], "stop", STOP)


@pytest.mark.parametrize("min_tokens, expected, stop_reason", [
    (0, [EOS], None),
    (1, [EOS], None),
    (2, [EOS, STOP], STOP),
    (3, [EOS, STOP, EOS], None),
    (5, [EOS, STOP, EOS, STOP, 9], None),
])
def test_min_tokens_suppresses_eos_and_stop_tokens(min_tokens, expected, stop_reason):
    script = [EOS, STOP, EOS, STOP, 9, EOS]
    out_tokens, last = finish(script, max_tokens=5, min_tokens=min_tokens, stop_token_ids=[STOP])
    assert (out_tokens, last.stop_reason) == (expected, stop_reason)
    assert last.finish_reason == ("length" if len(expected) == 5 else "stop")


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_generation_ends_at_max_model_len(ahead):
    d = Driver(kv_config(), max_model_len=16, ahead=ahead)
    request = d.add("r", tokens(10), max_tokens=None)
    d.run()
    assert len(d.tokens["r"]) == 6 and d.finished["r"].finish_reason == "length"
    assert len(request.token_ids) == 16


# -- C5: admission ---------------------------------------------------------------------------------

REJECTIONS = {
    "prompt + max_tokens over max_model_len": (dict(prompt=tokens(20), max_tokens=16), ["20 tokens", "16", "36", "32"]),
    "prompt fills max_model_len": (dict(prompt=tokens(32), max_tokens=None), ["32 tokens", "32"]),
    "empty prompt": (dict(prompt=[], max_tokens=4), ["empty"]),
    "never fits the cache": (dict(prompt=tokens(28), max_tokens=4), ["8 blocks", "only 7"]),
    "duplicate id": (dict(rid="ok", prompt=tokens(4), max_tokens=4), ["'ok'", "already"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", REJECTIONS)
def test_impossible_requests_are_rejected_at_once_and_others_are_served(layout, case):
    kwargs, fragments = dict(REJECTIONS[case][0]), REJECTIONS[case][1]
    d = Driver(kv_config(layout, num_blocks=8), max_model_len=32)  # 7 blocks = 28 tokens per group
    d.add("ok", tokens(8), max_tokens=4)
    d.step()
    prompt = kwargs.pop("prompt")
    with pytest.raises(RequestRejected) as info:
        d.add(kwargs.pop("rid", "bad"), prompt, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)
    d.add("ok2", tokens(8, start=50), max_tokens=4)
    d.run()
    assert set(d.finished) == {"ok", "ok2"}
    assert d.scheduler.requests == {}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("bad_token", [-1, 2**32])
def test_invalid_token_ids_are_rejected_at_admission(caching, bad_token):
    """Token ids that cannot be hashed or embedded are the caller's error, not the next step's."""
    d = Driver(kv_config(caching=caching))
    d.add("ok", tokens(8), max_tokens=4)
    with pytest.raises(RequestRejected, match=str(bad_token)):
        d.add("bad", [1, 2, 3, bad_token, 5], max_tokens=4)
    d.run()
    assert set(d.finished) == {"ok"}


def test_rejected_request_is_marked_and_a_request_that_exactly_fills_the_cache_runs():
    d = Driver(kv_config(num_blocks=8))  # 7 blocks = 28 tokens
    big = Request("big", tokens(26), SamplingParams(max_tokens=4))
    with pytest.raises(RequestRejected):
        d.scheduler.add_request(big)
    assert big.status is RequestStatus.FINISHED_REJECTED and "only 7" in big.error
    assert "big" not in d.scheduler.requests
    exact = d.add("exact", tokens(24), max_tokens=4)
    d.run()
    assert len(d.tokens["exact"]) == 4 and exact.status is RequestStatus.FINISHED_LENGTH


# -- abort -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_abort_at_any_time_is_idempotent_and_frees_everything(layout):
    d = Driver(kv_config(layout), max_num_seqs=2, max_num_batched_tokens=16, max_prefill_chunk=6)
    d.add("done", tokens(4), max_tokens=1)
    d.step()
    d.add("prefilling", tokens(12, start=20), max_tokens=4)
    d.add("decoding", tokens(4, start=40), max_tokens=4)
    d.add("waiting", tokens(4, start=60), max_tokens=4)
    d.step()
    s = d.scheduler
    assert [r.request_id for r in s.running] == ["prefilling", "decoding"] and d.waiting_ids() == ["waiting"]
    assert s.requests["prefilling"].num_computed_tokens == 6
    ids = ["prefilling", "decoding", "waiting", "done", "unknown"]
    assert d.abort(ids) == ["prefilling", "decoding", "waiting"]
    assert d.abort(ids) == []
    assert d.in_use() == [0] * len(d.in_use()) and not s.requests and not s.running and not s.waiting
    out = d.schedule()
    assert out.finished_request_ids == {"prefilling", "decoding", "waiting"} and out.is_empty
    d.update(out)
    s.assert_idle()


# -- C2: idle --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_assert_idle_needs_the_last_schedule_to_hand_over_finished_ids(layout):
    d = Driver(kv_config(layout, zero=True))
    d.add("r", tokens(9), max_tokens=1)
    out = d.step()[0]
    assert all(out.blocks_to_zero[g] for g in range(len(d.kv.config.groups)))  # zero orders were handed out
    assert not d.scheduler.has_unfinished_requests()
    with pytest.raises(AssertionError, match="finished ids"):
        d.scheduler.assert_idle()
    assert d.schedule().finished_request_ids == {"r"}
    d.scheduler.assert_idle()
    ghost = Request("ghost", tokens(4), SamplingParams())
    ghost.block_hashes = d.kv.new_block_hashes()
    d.kv.allocate_slots(ghost, 4)
    with pytest.raises(AssertionError, match="never drained"):
        d.scheduler.assert_idle()
    d.kv.take_pending()
    with pytest.raises(AssertionError, match="still hold blocks"):
        d.scheduler.assert_idle()  # it also checks the KV cache


# -- stats -----------------------------------------------------------------------------------------


def test_stats_count_running_waiting_and_usage_per_group():
    d = Driver(kv_config("full+state", num_blocks=9, num_slots=5), max_num_seqs=2)  # 8 blocks, 4 slots
    for i in range(3):
        d.add(f"r{i}", tokens(8, start=20 * i), max_tokens=2)
    stats = d.step()[2]
    assert (stats.num_running, stats.num_waiting, stats.num_scheduled_tokens) == (2, 1, 16)
    assert stats.kv_usage == [4 / 8, 2 / 4]
    assert (stats.prefix_cache_queries, stats.num_preemptions) == (0, 0)


def test_stats_count_prefix_queries_and_hits_cumulatively():
    d = Driver(kv_config())
    d.add("a", tokens(12), max_tokens=1)
    assert d.step()[2].prefix_cache_queries == 12
    d.add("b", tokens(13), max_tokens=1)
    d.add("c", tokens(6), max_tokens=1)
    stats = d.step()[2]
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12 + 13 + 6, 12 + 4)


# -- everything at once ----------------------------------------------------------------------------


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_streams_keep_every_invariant(seed, layout, policy, ahead):
    """Arrivals with shared prefixes and salts, priorities, aborts of requests in any state (between
    schedule() and update), and a cache small enough to force preemption and eviction; ahead, each
    step scheduled before the previous one's output is applied, as async scheduling does."""
    rng = random.Random(seed)
    d = Driver(kv_config(layout, num_blocks=14, num_slots=5, caching=seed != 2), max_num_seqs=6,
               max_num_batched_tokens=12, max_prefill_chunk=rng.choice([None, 5]), max_model_len=48, policy=policy,
               ahead=ahead)
    prefixes = [tokens(rng.randrange(4, 17), start=100 * k) for k in range(3)]
    aborted, added = set(), {}
    for _ in range(400):
        if len(added) < 40 and rng.random() < 0.5:
            rid = f"r{len(added)}"
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            added[rid] = rng.randrange(1, 16)
            d.add(rid, prompt, priority=rng.randrange(3), salt=rng.choice([None, "s"]), max_tokens=added[rid])
        out = d.schedule()
        if rng.random() < 0.05 and d.scheduler.requests:
            victim = rng.choice(sorted(d.scheduler.requests))
            aborted.update(d.abort([victim]))
        d.apply(out)
        if len(added) == 40 and not d.scheduler.has_pending_work():
            break
    d.run()
    assert set(d.finished) | aborted == set(added) and not set(d.finished) & aborted
    assert all(len(d.tokens[rid]) == added[rid] for rid in d.finished)
    assert d.num_preemptions > 0
