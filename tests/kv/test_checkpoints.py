"""Recurrent-state checkpoints in the KV manager: restores are copies, captures sit on the stride
where later requests can hit, eviction knows what a checkpoint saves, and the books balance."""

from __future__ import annotations

import pytest

from blockserve.kv import KVCacheConfig, KVCacheGroup, KVCacheManager, LinearStateSpec
from blockserve.kv.capacity import plan_kv_cache
from blockserve.kv.checkpoint_policy import CapturePlan
from tests.kv.conftest import full, new_req

STATE = LinearStateSpec(shapes=((3, 8), (2, 4, 4)), dtypes=("float32", "float32"), chunk_size=2)
SYSTEM = list(range(100, 110))  # 10 tokens: two strides of 4 and a half


def manager_with(num_checkpoints: int = 8, poison: bool = False, weight: float = 0.0, blocks: int = 64):
    """Full attention (blocks of 4) + a state group (4 running slots): stride lcm(4, 2) = 4."""
    groups = (KVCacheGroup(full(4), blocks, False), KVCacheGroup(STATE, 5, True, num_checkpoints=num_checkpoints))
    return KVCacheManager(KVCacheConfig(groups, poison_freed_blocks=poison, checkpoint_savings_weight=weight))


def step(manager, req, n, hit=None):
    """One scheduler step for `req` computing `n` tokens: allocate, plan captures, take the
    step's orders, then (after the "forward") cache what it wrote. Returns the orders."""
    assert manager.allocate_slots(req, n, hit) is not None
    manager.plan_captures(req, req.num_computed_tokens + (hit.num_tokens if hit else 0), n)
    orders = manager.take_pending()
    req.num_computed_tokens += (hit.num_tokens if hit else 0) + n
    manager.cache_blocks(req, req.num_computed_tokens)
    manager.check_integrity()
    return orders


def serve(manager, rid, tokens, decode=0):
    """Admit, prefill in one step, decode `decode` tokens, finish. Returns (hit, the first step's orders)."""
    req = new_req(manager, rid, tokens)
    hit = manager.get_computed_blocks(req)
    orders = step(manager, req, len(tokens) - hit.num_tokens, hit)
    for t in range(decode):
        req.token_ids.append(900 + t)
        step(manager, req, 1)
    manager.free(rid)
    manager.check_integrity()
    return hit, orders


def test_a_restore_is_a_copy_into_a_running_slot_and_no_zero_order():
    manager = manager_with()
    _, first = serve(manager, "a", list(range(13)))
    assert [p for p, _ in first.state_captures[1]["a"]] == [12]
    hit, orders = serve(manager, "b", list(range(13)) + [7, 7])
    assert hit.num_tokens == 12
    (src, dst), = orders.state_copies[1]
    assert src == first.state_captures[1]["a"][0][1] and 1 <= dst < 5
    assert dst not in orders.blocks_to_zero.get(1, [])  # restored, not zeroed (C1)
    assert manager.prefix_cache_stats().checkpoint_restores == 1
    manager.assert_idle()


def test_a_shared_prefix_short_of_two_strides_hits_at_its_second_sighting():
    """vLLM inflates blocks to the state's size, so such prompts never hit: here the first
    request's prefill-end checkpoint (8, inside the 10-token system prompt) serves the second."""
    manager = manager_with()
    serve(manager, "a", SYSTEM + [1])
    hit, _ = serve(manager, "b", SYSTEM + [2, 2])
    assert hit.num_tokens == 8


def test_a_prompt_on_the_stride_hits_when_sent_again():
    """A hit leaves the last token to compute, so a 16-token prompt sent again can restore at most
    12: the first sighting captures there too (vLLM #50409: 0 hits)."""
    manager = manager_with()
    _, orders = serve(manager, "a", list(range(16)))
    assert sorted(p for p, _ in orders.state_captures[1]["a"]) == [12, 16]
    hit, _ = serve(manager, "b", list(range(16)))
    assert hit.num_tokens == 12


def test_a_prefix_ending_in_the_first_requests_unique_suffix_is_captured_at_the_junction():
    """a's only checkpoints lie in its unique suffix; b shares 12 tokens with it. b finds the
    attention blocks but no state (the loss is counted), so it captures at the junction and c,
    the third sighting, hits all 12."""
    manager = manager_with()
    shared = list(range(12))
    serve(manager, "a", shared + [50] * 9)
    hit_b, orders = serve(manager, "b", shared + [60] * 9)
    assert hit_b.num_tokens == 0 and hit_b.state_lost_tokens == 12
    assert 12 in [p for p, _ in orders.state_captures[1]["b"]]
    hit_c, _ = serve(manager, "c", shared + [70] * 9)
    assert hit_c.num_tokens == 12
    assert manager.prefix_cache_stats().state_lost_tokens == 12


def test_the_next_turn_restores_the_previous_turns_end_from_the_decode_spare():
    manager = manager_with()
    prompt = list(range(10))
    serve(manager, "turn1", prompt, decode=7)  # 17 tokens written: the spare moved 12 -> 16
    history = prompt + [900 + t for t in range(7)]
    hit, _ = serve(manager, "turn2", history + [900 + 7, 1, 2, 3])
    assert hit.num_tokens == 16
    captured = manager.coordinator.state_managers[0].checkpoints
    positions = sorted(c.position for c in captured.cached.values())
    assert 12 not in positions  # one spare for the reply, overwritten at each boundary


def verify(manager, req, num_drafts, accepted):
    """One speculative step: score `num_drafts` drafts after the request's last token, the target
    accepting the first `accepted`; then trim and cache as the scheduler does with the result."""
    start, n = req.num_computed_tokens, 1 + num_drafts
    assert manager.allocate_slots(req, n) is not None
    manager.plan_captures(req, start, n)
    manager.take_pending()
    req.num_computed_tokens = start + 1 + accepted
    req.token_ids += [800 + len(req.token_ids) + i for i in range(accepted + 1)]  # accepted drafts, then its own
    manager.trim_slots(req, len(req.token_ids))
    manager.cache_blocks(req, req.num_computed_tokens)
    manager.check_integrity()


def decoded_to_a_spare_at_12(manager, rid):
    """A 10-token prompt decoded until its spare holds position 12 (12 tokens computed, 13 known)."""
    req = new_req(manager, rid, list(range(10)))
    step(manager, req, 10, manager.get_computed_blocks(req))
    for t in range(3):
        req.token_ids.append(900 + t)
        if t < 2:
            step(manager, req, 1)
    assert cached_positions(manager) == [8, 12]
    return req


def cached_positions(manager):
    return sorted(c.position for c in manager.coordinator.state_managers[0].checkpoints.cached.values())


def next_turn_hit(manager, req):
    history = list(req.token_ids)
    manager.free(req.request_id)
    hit, _ = serve(manager, "next", history + [1, 2, 3])
    manager.assert_idle()
    return hit.num_tokens


def test_a_rejected_draft_before_a_boundary_keeps_the_previous_decode_checkpoint():
    """Verifying [12, 17) crosses 16, but the first draft is rejected: 16's capture is dropped (C4),
    and the spare at 12 the reply already had is still cached for the next turn."""
    manager = manager_with()
    req = decoded_to_a_spare_at_12(manager, "a")
    verify(manager, req, num_drafts=4, accepted=0)
    assert cached_positions(manager) == [8, 12]
    assert next_turn_hit(manager, req) == 12


@pytest.mark.parametrize("accepted, deepest", [(5, 16), (7, 20)])
def test_every_accepted_boundary_of_a_verification_is_captured(accepted, deepest):
    """Verifying [12, 20) crosses 16 and 20: the deepest accepted one becomes the reply's one spare."""
    manager = manager_with()
    req = decoded_to_a_spare_at_12(manager, "a")
    verify(manager, req, num_drafts=7, accepted=accepted)
    assert cached_positions(manager) == [8, deepest]
    assert next_turn_hit(manager, req) == deepest


def test_a_verification_in_a_full_pool_captures_in_place_of_its_spare():
    """With no other slot to take, a verification captures into its own spare (as a plain decode
    does): accepted, the spare moves on; rejected, it is lost (best effort, never a wrong hit)."""
    for accepted, positions in [(4, [16]), (0, [])]:
        manager = manager_with(num_checkpoints=1)
        req = new_req(manager, "a", list(range(10)) + [900, 901])
        step(manager, req, 11, manager.get_computed_blocks(req))
        step(manager, req, 1)
        assert cached_positions(manager) == [12]
        req.token_ids.append(902)
        verify(manager, req, num_drafts=4, accepted=accepted)
        assert cached_positions(manager) == positions
        manager.free("a")
        manager.assert_idle()


def test_a_tiny_pool_degrades_to_fewer_hits_never_a_wrong_one():
    manager = manager_with(num_checkpoints=1)
    for i in range(6):
        serve(manager, f"r{i}", SYSTEM + [i] * 7)
    pool = manager.coordinator.state_managers[0].checkpoints
    assert len(pool.cached) == 1 and pool.num_evictions > 0
    manager.assert_idle()


def test_a_checkpoint_whose_attention_block_is_evicted_is_released_at_once():
    manager = manager_with(blocks=6)  # 5 usable blocks of 4 tokens
    serve(manager, "a", list(range(13)))  # captures 12; its blocks stay cached
    pool = manager.coordinator.state_managers[0].checkpoints
    assert len(pool.cached) == 1
    serve(manager, "b", list(range(200, 217)))  # needs all 5 blocks: evicts a's
    assert not any(c.position == 12 and c.cached for c in pool.checkpoints)
    manager.assert_idle()


def test_a_pending_restore_pins_its_checkpoint_until_the_steps_orders_are_taken():
    manager = manager_with(num_checkpoints=1, poison=True)
    serve(manager, "a", list(range(13)))
    b = new_req(manager, "b", list(range(13)) + [1])
    hit = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 2, hit) is not None
    pool = manager.coordinator.state_managers[0].checkpoints
    ckpt = hit.blocks[1][0]
    assert ckpt.ref_cnt == 1
    # Another request's capture in the same step finds no slot rather than evict the pinned one.
    c = new_req(manager, "c", list(range(300, 309)))
    assert manager.allocate_slots(c, 9) is not None
    manager.plan_captures(c, 0, 9)
    orders = manager.take_pending()
    assert 1 not in orders.state_captures and ckpt.slot not in orders.blocks_to_poison.get(1, [])
    assert ckpt.ref_cnt == 0 and ckpt.cached
    manager.check_integrity()


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_eviction_ranks_by_recency_and_by_tokens_saved(weight):
    """Two checkpoints: an old deep one (saves 12 tokens) and a recent shallow one (saves 4).
    LRU evicts the old one; a full weight on savings evicts the shallow one."""
    manager = manager_with(num_checkpoints=2, weight=weight)
    serve(manager, "deep", list(range(13)))  # checkpoint at 12, nothing shallower: saves 12
    serve(manager, "shallow", [5] * 5)  # checkpoint at 4: saves 4
    serve(manager, "third", [6] * 9)  # needs a slot: evicts one
    pool = manager.coordinator.state_managers[0].checkpoints
    kept = sorted(c.saves for c in pool.cached.values())
    assert kept == ([4, 8] if weight == 0.0 else [8, 12])


def test_reset_forgets_checkpoints_and_refuses_while_requests_run():
    manager = manager_with(poison=True)
    serve(manager, "a", list(range(13)))
    req = new_req(manager, "b", [1, 2, 3])
    step(manager, req, 3)
    assert not manager.reset_prefix_cache().ok
    manager.free("b")
    assert manager.reset_prefix_cache().ok
    pool = manager.coordinator.state_managers[0].checkpoints
    assert not pool.cached and pool.num_free == pool.capacity
    assert set(manager.take_pending().blocks_to_poison[1]) >= {c.slot for c in pool.checkpoints[:1]}
    hit, _ = serve(manager, "c", list(range(13)))
    assert hit.num_tokens == 0
    manager.assert_idle()


def test_salts_keep_checkpoints_apart():
    manager = manager_with()
    serve(manager, "a", list(range(13)))
    other = new_req(manager, "b", list(range(13)), salt="tenant-b")
    assert manager.get_computed_blocks(other).num_tokens == 0


def test_capture_plan_positions():
    plan = CapturePlan(stride=4, prefill_end=18, junction=8, interval=0)
    assert plan.positions(0, 18) == ([8, 16], False)
    assert plan.positions(9, 18) == ([16], False)
    assert plan.positions(18, 19) == ([], True) and plan.positions(19, 20) == ([20], True)
    assert plan.positions(19, 28) == ([20, 24, 28], True)  # a verification: every boundary among its tokens
    assert CapturePlan(4, 16).positions(0, 16) == ([12, 16], False)
    assert CapturePlan(4, 30, interval=2).positions(0, 30) == ([8, 16, 24, 28], False)


def test_capacity_plans_checkpoints_from_the_share_and_reports_the_stride():
    layers = [(full(4), ("attn",), False), (STATE, ("s1", "s2"), False)]
    slot = 2 * STATE.page_size_bytes
    config = plan_kv_cache(layers, 2**20, 64, 4, checkpoint_share=0.25)
    state = next(g for g in config.groups if g.is_state)
    assert state.num_checkpoints == int(0.25 * 2**20) // slot and state.num_slots == 5 + state.num_checkpoints
    assert config.checkpoint_stride == 4
    report = config.capacity_report()
    assert f"{state.num_checkpoints} checkpoints every 4 tokens" in report and "tokens of attention KV" in report
    off = plan_kv_cache(layers, 2**20, 64, 4, checkpoint_share=0.25, enable_prefix_caching=False)
    assert next(g for g in off.groups if g.is_state).num_checkpoints == 0
