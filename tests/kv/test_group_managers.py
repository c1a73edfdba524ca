"""Per-group managers: how full, sliding-window and linear-state layers use their block tables."""

import pytest

from blockserve.kv import BlockHashChain, PendingWork
from blockserve.kv.block_pool import BlockPool
from blockserve.kv.group_managers import make_attention_manager
from blockserve.kv.specs import cdiv
from blockserve.kv.state_manager import LinearStateManager
from tests.kv.conftest import decode, full, make_manager, mla, new_req, plant, prefill, sliding, state

HASHES = BlockHashChain([4]).get(4, list(range(40)))  # 10 blocks of 4 tokens
SALTED = BlockHashChain([4], cache_salt="other").get(4, list(range(40)))


def group_manager(spec, num_blocks=16):
    return make_attention_manager(spec, BlockPool(num_blocks, 0, PendingWork(), False))


def ids(blocks):
    return [b.block_id for b in blocks]


@pytest.mark.parametrize("spec", [full(), mla()])
def test_full_hit_is_the_longest_cached_run_from_the_left(spec):
    m = group_manager(spec)
    planted = plant(m.pool, HASHES, [0, 1, 2, 4, 5])
    assert m.find_longest_hit(HASHES, 40) == [planted[0], planted[1], planted[2]]
    assert m.find_longest_hit(HASHES, 11) == [planted[0], planted[1]]  # bounded by whole blocks
    assert m.find_longest_hit(SALTED, 40) == []


def test_sliding_hit_is_searched_from_the_right():
    m = group_manager(sliding(block_size=4, window=6))  # needs cdiv(5, 4) = 2 blocks before a position
    planted = plant(m.pool, HASHES, [0, 1, 2, 5, 6, 8])
    null = m.pool.null_block
    assert m.find_longest_hit(HASHES, 40) == [null] * 5 + [planted[5], planted[6]]
    assert m.find_longest_hit(HASHES, 27) == [null] * 1 + [planted[1], planted[2]]
    assert m.find_longest_hit(SALTED, 40) == []


def test_a_sliding_run_reaching_the_first_block_is_a_hit_even_if_shorter_than_the_window():
    m = group_manager(sliding(block_size=4, window=13))  # needs 3 blocks
    planted = plant(m.pool, HASHES, [0, 1, 3, 4])
    assert m.find_longest_hit(HASHES, 40) == [planted[0], planted[1]]


def test_linear_state_without_checkpoints_has_no_hit_and_one_slot():
    pending = PendingWork()
    m = LinearStateManager(state(), BlockPool(16, 0, pending, False), None, 4, pending)
    plant(m.pool, HASHES, [0])
    assert m.find_longest_hit(HASHES, 40) == []
    assert [m.table_len(n) for n in (0, 1, 1000)] == [0, 1, 1]
    assert len(m.allocate_new_blocks("r", 5)) == 1
    assert m.allocate_new_blocks("r", 500) == []
    m.cache_blocks("r", HASHES, 40)
    assert set(m.pool.cached) == {HASHES[0]}  # nothing added


def test_blocks_to_allocate_count_revived_hit_blocks():
    m = group_manager(full(), num_blocks=8)
    planted = plant(m.pool, HASHES, [0, 1])
    hit = [planted[0], planted[1]]
    # Two revived from the evictable queue plus one new block for tokens 8..9.
    assert m.num_blocks_to_allocate("r", 10, hit) == 3
    m.pool.touch([planted[0]])  # held by someone else: no longer counted
    assert m.num_blocks_to_allocate("r", 10, hit) == 2


def test_a_finished_requests_deepest_block_is_evicted_first():
    manager = make_manager((full(4), 4))
    prefill(manager, new_req(manager, "a", list(range(12))))
    manager.free("a")
    prefill(manager, new_req(manager, "b", [99]))  # evicts one of a's blocks
    hit, _ = prefill(manager, new_req(manager, "c", list(range(13))))
    assert hit.num_tokens == 8


def test_cache_blocks_registers_only_full_written_blocks_once():
    manager = make_manager((full(), 16))
    req = new_req(manager, "r", list(range(10)))
    manager.allocate_slots(req, 10)
    m = manager.coordinator.managers[0]
    manager.cache_blocks(req, 7)
    assert len(m.pool.cached) == 1 and m.num_cached["r"] == 1
    manager.cache_blocks(req, 10)
    manager.cache_blocks(req, 10)
    assert len(m.pool.cached) == 2 and m.num_cached["r"] == 2
    assert [b.block_hash for b in m.req_blocks["r"][:2]] == req.block_hashes.get(4, req.token_ids)[:2]


@pytest.mark.parametrize(("block_size", "window"), [(4, 6), (4, 4), (4, 1), (8, 20), (16, 3)])
def test_a_decoding_sliding_window_request_holds_at_most_the_window_plus_one_block(block_size, window):
    manager = make_manager((sliding(block_size, window), 64))
    pool = manager.coordinator.pools[0]
    req = new_req(manager, "r", list(range(10)))
    prefill(manager, req)
    bound = cdiv(window, block_size) + 1
    for step in range(200):
        before = req.num_computed_tokens
        assert decode(manager, req, step % 7) is not None
        table = manager.block_ids("r")[0]
        real = [b for b in table if b != 0]
        first_needed = max(0, before - window + 1) // block_size
        assert len(table) == cdiv(len(req.token_ids), block_size)
        assert table[:first_needed] == [0] * first_needed and 0 not in table[first_needed:]
        assert len(real) <= bound
        assert pool.num_free == pool.capacity - len(real)
        manager.check_integrity()
    assert sliding(block_size, window).max_blocks_held(10**6, max_chunk_tokens=1) == bound
    manager.free("r")
    manager.assert_idle()
