"""KVCacheManager: zero and poison orders drained by take_pending (C1, C2), admission, reset, stats."""

import pytest

from tests.kv.conftest import compute, decode, full, make_manager, mla, new_req, prefill, sliding, state

TOKENS = list(range(1000, 1040))


def test_zero_orders_only_for_flagged_groups_and_only_for_new_blocks():
    manager = make_manager((full(4), 32, False), (sliding(4, 6), 32, True))
    _, ids = prefill(manager, new_req(manager, "a", TOKENS[:16]))
    assert manager.take_pending().blocks_to_zero == {1: ids[1]}
    manager.free("a")
    hit, ids = prefill(manager, new_req(manager, "b", TOKENS[:24]))
    assert hit.num_tokens == 16
    new_blocks = ids[1][len(hit.blocks[1]) :]  # the hit's blocks come first
    assert manager.take_pending().blocks_to_zero == {1: new_blocks} and len(new_blocks) == 2


def test_state_slots_are_zeroed_for_every_new_request():
    manager = make_manager((mla(4), 32, False), (state(), 4, True))
    for rid in "abc":
        req = new_req(manager, rid, TOKENS[:9])
        _, ids = prefill(manager, req)
        decode(manager, req, 1)
        assert manager.take_pending().blocks_to_zero == {1: ids[1]}
        manager.free(rid)


def test_take_pending_drains_everything():
    manager = make_manager((full(4), 6, True), (sliding(4, 6), 6, True), poison=True)
    for rid, start in (("a", 0), ("b", 20)):  # b evicts a's cached blocks
        prefill(manager, new_req(manager, rid, TOKENS[start : start + 20]))
        manager.free(rid)
    taken = manager.take_pending()
    assert set(taken.blocks_to_zero) == set(taken.blocks_to_poison) == {0, 1}
    assert manager.take_pending().is_empty() and manager.pending_is_empty()
    manager.assert_idle()


def test_reset_is_refused_in_every_group_while_any_group_is_in_use():
    manager = make_manager((full(4), 8), (sliding(4, 6), 8))
    prefill(manager, new_req(manager, "a", TOKENS[:12]))
    manager.free("a")
    prefill(manager, new_req(manager, "b", TOKENS[20:22]))
    manager.take_pending()
    result = manager.reset_prefix_cache()
    assert not result.ok and "in use" in result.reason
    assert manager.take_pending().is_empty()
    assert prefill(manager, new_req(manager, "c", TOKENS[:12]))[0].num_tokens == 8  # cache intact
    manager.free("b")
    manager.free("c")
    assert manager.reset_prefix_cache().ok
    assert prefill(manager, new_req(manager, "d", TOKENS[:12]))[0].num_tokens == 0


def test_no_hits_and_nothing_cached_with_prefix_caching_off():
    manager = make_manager((full(4), 16), caching=False)
    prefill(manager, new_req(manager, "a", TOKENS[:12]))
    manager.free("a")
    assert prefill(manager, new_req(manager, "b", TOKENS[:12]))[0].num_tokens == 0
    assert not manager.coordinator.pools[0].cached


def test_block_ids_free_and_assert_idle():
    manager = make_manager((full(4), 16), (sliding(4, 6), 16), (state(), 3))
    req = new_req(manager, "a", TOKENS[:10])
    assert manager.allocate_slots(req, 13) == [[1, 2, 3, 4], [1, 2, 3, 4], [1]]
    assert manager.block_ids("a") == [[1, 2, 3, 4], [1, 2, 3, 4], [1]]
    assert manager.usage() == [4 / 15, 4 / 15, 1 / 2]
    with pytest.raises(AssertionError, match="still hold blocks"):
        manager.assert_idle()
    manager.free("a")
    manager.free("a")  # idempotent
    assert manager.block_ids("a") == [[], [], []]
    manager.assert_idle()


def test_allocate_slots_needs_a_positive_token_count():
    manager = make_manager((full(4), 4))
    with pytest.raises(ValueError, match="num_new_tokens > 0"):
        manager.allocate_slots(new_req(manager, "a", TOKENS[:4]), 0)


def test_check_integrity_catches_a_table_out_of_step_with_the_pool():
    manager = make_manager((full(4), 8))
    prefill(manager, new_req(manager, "a", TOKENS[:6]))
    manager.coordinator.managers[0].req_blocks["a"].pop()  # forget the partial block 2
    with pytest.raises(AssertionError, match="block 2 has ref_cnt 1 but 0 holders"):
        manager.check_integrity()


def test_never_fits():
    manager = make_manager((full(4), 11), (sliding(4, 6), 4), (state(), 2))
    assert manager.never_fits(12) is None
    reason = manager.never_fits(13)
    assert "13 tokens needs 4 blocks of KV cache group 1 (SlidingWindowSpec)" in reason
    assert "only 3" in reason
    assert manager.never_fits(40, max_chunk_tokens=1) is None  # the window needs 3 blocks
    assert manager.never_fits(40, max_chunk_tokens=4) is not None  # cdiv(5 + 4, 4) + 1 = 4
    assert "group 0 (FullAttentionSpec)" in manager.never_fits(41, max_chunk_tokens=1)


def test_a_request_that_fits_alone_does_fit():
    manager = make_manager((full(4), 11), (sliding(4, 6), 4), (state(), 2))
    req = new_req(manager, "a", TOKENS[:1])
    prefill(manager, req)
    while len(req.token_ids) < 40:
        assert decode(manager, req, 7) is not None
    assert manager.num_free_blocks()[0] == 0


def test_prefix_cache_stats():
    manager = make_manager((full(4), 32))
    prefill(manager, new_req(manager, "a", TOKENS[:16]))
    prefill(manager, new_req(manager, "b", TOKENS[:10]))
    stats = manager.prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.evictions) == (2, 26, 8, 0)
    assert stats.hit_rate == 8 / 26


def test_chunked_prefill_caches_blocks_as_their_kv_is_written():
    manager = make_manager((full(4), 32), (sliding(4, 6), 32))
    req = new_req(manager, "a", TOKENS[:20])
    for chunk in (6, 6, 8):
        assert manager.allocate_slots(req, chunk) is not None
        compute(manager, req, chunk)
    # The third chunk starts at token 12, which sees tokens 7 on: block 0 left the window.
    assert manager.block_ids("a")[1] == [0, 2, 3, 4, 5]
    assert prefill(manager, new_req(manager, "b", TOKENS[:20]))[0].num_tokens == 16
    manager.check_integrity()


def test_a_held_twin_block_serves_hits_after_the_cached_one_is_evicted():
    """Two requests that computed the same prefix at once hold twin blocks, and `BlockPool.cache`
    enters only the first twin in the prefix cache. Once that one is evicted, the twin a running
    request still holds must keep serving hits (vLLM maps a hash to every block holding it)."""
    manager = make_manager((full(4), 8))
    prompt = TOKENS[:12]
    a, b = new_req(manager, "a", prompt), new_req(manager, "b", prompt)
    for req in (a, b):  # admitted in the same step: neither has a hit
        assert manager.allocate_slots(req, 12) is not None
    for req in (a, b):
        compute(manager, req, 12)
    manager.free("a")
    prefill(manager, new_req(manager, "c", TOKENS[20:36]))  # 4 blocks: evicts all of a's
    hit = manager.get_computed_blocks(new_req(manager, "d", prompt))
    assert hit.num_tokens == 8  # b still holds the prefix's KV
