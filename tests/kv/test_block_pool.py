"""One group's pool: eviction order, the prefix-cache map, reset, zero and poison orders."""

import pytest

from blockserve.kv import NULL_BLOCK_ID, PendingWork
from blockserve.kv.block_pool import BlockPool

H = [bytes([i]) * 32 for i in range(16)]  # stand-in block hashes


def make_pool(num_blocks=9, group_id=0, zero=False, poison=False):
    pending = PendingWork()
    return BlockPool(num_blocks, group_id, pending, zero, poison), pending


def ids(blocks):
    return [b.block_id for b in blocks]


def cached_and_freed(pool, hashes):
    """Blocks holding `hashes`, cached then freed tail first as a finished request's are."""
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache(blocks, hashes)
    pool.free(reversed(blocks))
    return blocks


def test_a_fresh_pool_hands_out_low_ids_and_never_the_null_block():
    pool, _ = make_pool(num_blocks=5)
    assert pool.capacity == pool.num_free == 4
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.null_block.block_id == NULL_BLOCK_ID == 0
    assert pool.num_free == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        pool.get_new_blocks(1)


def test_never_cached_blocks_are_handed_out_before_cached_ones():
    pool, _ = make_pool(num_blocks=9)
    cached = cached_and_freed(pool, H[:3])  # blocks 1-3, evictable
    plain = pool.get_new_blocks(2)  # blocks 4-5
    pool.free(plain)
    assert set(ids(pool.get_new_blocks(5))) == {4, 5, 6, 7, 8}
    assert all(pool.lookup(h) is b for h, b in zip(H[:3], cached))
    assert pool.num_evictions == 0


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool, _ = make_pool(num_blocks=5)
    first = cached_and_freed(pool, H[0:2])  # freed: 2, 1
    second = cached_and_freed(pool, H[2:4])  # freed: 4, 3
    order = [pool.get_new_blocks(1)[0] for _ in range(4)]
    assert order == [first[1], first[0], second[1], second[0]]
    assert pool.num_evictions == 4 and not pool.cached


def test_a_requests_deepest_block_is_evicted_first():
    pool, _ = make_pool(num_blocks=4)
    cached_and_freed(pool, H[:3])
    pool.get_new_blocks(1)
    assert pool.lookup(H[2]) is None
    assert pool.lookup(H[0]) is not None and pool.lookup(H[1]) is not None


def test_touch_revives_an_evictable_block():
    pool, _ = make_pool(num_blocks=4)
    blocks = cached_and_freed(pool, H[:3])
    pool.touch([blocks[2]])  # the block that would be evicted next
    assert blocks[2].ref_cnt == 1 and pool.num_free == 2
    assert pool.get_new_blocks(2) == [blocks[1], blocks[0]]
    assert pool.lookup(H[2]) is blocks[2]
    pool.check_integrity({1: 1, 2: 1, 3: 1})
    # Freed again, it is the most recently freed.
    pool.free([blocks[2]])
    assert list(pool._evictable) == [blocks[2].block_id]


def test_touch_and_free_count_references():
    pool, _ = make_pool()
    block = cached_and_freed(pool, H[:1])[0]
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.check_integrity({block.block_id: 2})
    pool.free([block])
    assert pool.num_free == pool.capacity - 1
    pool.free([block])
    assert pool.num_free == pool.capacity
    pool.check_integrity({})


def test_the_null_block_is_ignored_by_touch_free_and_cache():
    pool, _ = make_pool()
    pool.touch([pool.null_block])
    pool.free([pool.null_block, pool.null_block])
    pool.cache([pool.null_block], [H[0]])
    assert pool.null_block.ref_cnt == 1 and pool.lookup(H[0]) is None
    pool.check_integrity({})


def test_twin_blocks_of_one_hash_are_both_cached_and_evicted_one_at_a_time():
    """Two requests that computed the same block in the same step both register it; evicting
    one twin keeps the hash until the last twin goes."""
    pool, _ = make_pool(num_blocks=3)  # just the two twins
    a, b = pool.get_new_blocks(2)
    pool.cache([a], [H[0]])
    pool.cache([b], [H[0]])
    assert pool.lookup(H[0]) is a and b.block_hash == H[0]
    pool.free([a, b])
    pool.check_integrity({})
    first = pool.get_new_blocks(1)[0]
    assert pool.lookup(H[0]) is not None
    second = pool.get_new_blocks(1)[0]
    assert {first, second} == {a, b} and pool.lookup(H[0]) is None and H[0] not in pool.cached
    pool.check_integrity({a.block_id: 1, b.block_id: 1})


def test_reset_is_refused_while_blocks_are_in_use_and_changes_nothing():
    pool, _ = make_pool()
    cached_and_freed(pool, H[:2])
    held = pool.get_new_blocks(1)
    before = (list(pool._uncached), list(pool._evictable), dict(pool.cached))
    result = pool.reset_prefix_cache()
    assert not result.ok and "1 blocks are still in use" in result.reason
    assert (list(pool._uncached), list(pool._evictable), dict(pool.cached)) == before
    pool.free(held)
    assert pool.reset_prefix_cache().ok
    assert not pool.cached and not pool._evictable and pool.num_free == pool.capacity
    assert pool.num_evictions == 0
    pool.check_integrity({})


@pytest.mark.parametrize("zero", [False, True])
def test_zero_orders_cover_exactly_the_new_blocks_of_a_flagged_pool(zero):
    pool, pending = make_pool(num_blocks=6, group_id=2, zero=zero)
    blocks = cached_and_freed(pool, H[:2])
    assert pending.take().blocks_to_zero == ({2: ids(blocks)} if zero else {})
    pool.touch(blocks)  # a prefix hit: holds the right KV, never zeroed
    new = pool.get_new_blocks(3)
    assert pending.take().blocks_to_zero == ({2: ids(new)} if zero else {})
    pool.get_new_blocks(0)
    assert pending.is_empty()


def test_a_reused_cached_block_gets_a_zero_order_too():
    pool, pending = make_pool(num_blocks=3, group_id=1, zero=True)
    blocks = cached_and_freed(pool, H[:2])
    pending.take()
    assert pool.get_new_blocks(2) == [blocks[1], blocks[0]]
    assert pending.take().blocks_to_zero == {1: [blocks[1].block_id, blocks[0].block_id]}


@pytest.mark.parametrize("poison", [False, True])
def test_poison_orders_name_exactly_the_blocks_whose_content_became_garbage(poison):
    pool, pending = make_pool(num_blocks=6, group_id=3, poison=poison)
    a, b, c = pool.get_new_blocks(3)
    pool.cache([a, b], H[:2])
    pool.free([c, b, a])  # c's partial content is garbage; a and b stay cached
    pool.touch([a])  # a prefix hit: still valid
    new = pool.get_new_blocks(4)  # three never-cached blocks, then b is evicted
    assert new[-1] is b
    pool.free(new)
    pool.free([a])
    pool.reset_prefix_cache()  # drops a's cached content
    expected = [c.block_id, b.block_id] + ids(new) + [a.block_id]
    assert pending.take().blocks_to_poison == ({3: expected} if poison else {})


def test_check_integrity_catches_broken_books():
    pool, _ = make_pool()
    block = pool.get_new_blocks(1)[0]
    with pytest.raises(AssertionError, match="1 holders|0 holders"):
        pool.check_integrity({})
    pool.check_integrity({block.block_id: 1})
    pool._uncached.append(block)  # a held block back in the free list
    with pytest.raises(AssertionError):
        pool.check_integrity({block.block_id: 1})
    pool._uncached.pop()
    block.block_hash = H[0]  # a hash with no map entry
    with pytest.raises(AssertionError, match="hash unmapped"):
        pool.check_integrity({block.block_id: 1})
