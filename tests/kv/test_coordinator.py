"""The coordinator: hits valid for every group at once, and allocations that succeed everywhere or nowhere."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockserve.kv import BlockHashChain, LinearStateSpec, SlidingWindowSpec
from blockserve.kv.specs import cdiv
from tests.kv.conftest import (
    decode,
    full,
    make_manager,
    mla,
    new_req,
    plant,
    prefill,
    sliding,
    snapshot,
    state,
)

TOKENS = list(range(64))


def coordinator_with(*specs, num_blocks=24):
    return make_manager(*((spec, num_blocks) for spec in specs)).coordinator


def hashes_for(block_size):
    return BlockHashChain([block_size]).get(block_size, TOKENS)


def find_hit(coordinator, cached_positions, max_tokens):
    """Plant `cached_positions[g]` in group g, then ask for the longest common hit."""
    planted = []
    for pool, manager, positions in zip(coordinator.pools, coordinator.managers, cached_positions):
        planted.append(plant(pool, hashes_for(manager.block_size), positions) if positions else {})
    num_tokens, hits = coordinator.find_longest_hit(hashes_for, max_tokens)
    return num_tokens, hits, planted


def can_serve(spec, positions, num_tokens):
    """Reference: can a group with these cached block positions supply the KV that computing from
    `num_tokens` on needs? A window of w needs the blocks holding the w - 1 tokens before it (the
    manager asks for at least one block, even when w = 1)."""
    if num_tokens == 0:
        return True
    if isinstance(spec, LinearStateSpec) or num_tokens % spec.block_size:
        return False
    end = num_tokens // spec.block_size
    start = 0
    if isinstance(spec, SlidingWindowSpec):
        start = max(0, end - max(1, cdiv(spec.sliding_window - 1, spec.block_size)))
    return all(p in positions for p in range(start, end))


def test_full_and_sliding_agree_on_the_longest_prefix_valid_for_both():
    coordinator = coordinator_with(full(4), sliding(4, window=6))
    n, hits, (f, s) = find_hit(coordinator, [range(8), {0, 1, 2, 4, 5}], max_tokens=31)
    assert n == 24
    assert hits[0] == [f[p] for p in range(6)]
    assert hits[1] == [coordinator.pools[1].null_block] * 4 + [s[4], s[5]]


def test_a_shorter_full_hit_makes_the_sliding_group_search_again_further_left():
    coordinator = coordinator_with(full(4), sliding(4, window=6))
    n, hits, (f, s) = find_hit(coordinator, [range(5), {0, 1, 2, 5, 6}], max_tokens=63)
    assert n == 12
    assert hits[0] == [f[0], f[1], f[2]]
    assert hits[1] == [coordinator.pools[1].null_block, s[1], s[2]]


def test_groups_with_different_block_sizes_hit_a_multiple_of_both():
    coordinator = coordinator_with(full(16), full(32))
    n, hits, _ = find_hit(coordinator, [range(4), range(2)], max_tokens=63)
    assert n == 32 and [len(h) for h in hits] == [2, 1]
    n, _, _ = find_hit(coordinator_with(full(16), full(32)), [range(3), range(2)], max_tokens=63)
    assert n == 32


def test_a_linear_state_group_without_checkpoint_slots_means_no_hit():
    coordinator = coordinator_with(mla(4), state())
    n, hits, _ = find_hit(coordinator, [range(16), ()], max_tokens=63)
    assert n == 0 and hits == [[], []]
    manager = make_manager((mla(4), 32), (state(), 4))
    prefill(manager, new_req(manager, "a", TOKENS))
    manager.free("a")
    hit, _ = prefill(manager, new_req(manager, "b", TOKENS))
    assert hit.num_tokens == 0


GROUP_SPECS = st.sampled_from(
    [full(4), full(8), mla(4), sliding(4, 1), sliding(4, 6), sliding(4, 13), sliding(8, 9), state()]
)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), specs=st.lists(GROUP_SPECS, min_size=1, max_size=3), max_tokens=st.integers(0, 64))
def test_the_hit_is_the_longest_prefix_every_group_can_serve(data, specs, max_tokens):
    positions = [
        set() if isinstance(spec, LinearStateSpec) else data.draw(st.sets(st.integers(0, 64 // spec.block_size - 1)))
        for spec in specs
    ]
    coordinator = coordinator_with(*specs)
    n, hits, planted = find_hit(coordinator, positions, max_tokens)
    expected = max(t for t in range(max_tokens + 1) if all(can_serve(s, p, t) for s, p in zip(specs, positions)))
    assert n == expected
    for spec, hit, group_planted, pool in zip(specs, hits, planted, coordinator.pools):
        assert len(hit) * spec.block_size == n
        real = {i: b for i, b in enumerate(hit) if b is not pool.null_block}
        assert all(group_planted[i] is b for i, b in real.items())


@pytest.mark.parametrize(
    ("specs", "expected"), [([full(4)], 12), ([full(4), sliding(4, 6)], 12), ([full(4), full(8)], 8)]
)
def test_a_hit_always_leaves_a_token_to_compute(specs, expected):
    manager = make_manager(*((spec, 32) for spec in specs))
    prefill(manager, new_req(manager, "a", TOKENS[:16]))  # 16 tokens: whole blocks, all cached
    hit, ids = prefill(manager, new_req(manager, "b", TOKENS[:16]))
    assert hit.num_tokens == expected and ids is not None
    manager.check_integrity()


def assert_fails_atomically(manager, req, num_new_tokens, hit=None):
    before = snapshot(manager)
    assert manager.allocate_slots(req, num_new_tokens, hit) is None
    assert snapshot(manager) == before
    manager.check_integrity()


def test_allocation_fails_atomically_when_the_sliding_group_is_full():
    manager = make_manager((full(4), 32, True), (sliding(4, 6), 4, True))
    prefill(manager, new_req(manager, "a", TOKENS[:12]))  # 3 blocks: the sliding pool is full
    assert_fails_atomically(manager, new_req(manager, "b", TOKENS[32:40]), 8)


def test_allocation_fails_atomically_when_the_state_group_is_full():
    manager = make_manager((mla(4), 32, False), (state(), 2, True))
    prefill(manager, new_req(manager, "a", TOKENS[:5]))
    assert_fails_atomically(manager, new_req(manager, "b", TOKENS[:5]), 5)


def test_a_failed_allocation_does_not_revive_its_hit():
    manager = make_manager((full(4), 6, True))
    prefill(manager, new_req(manager, "a", TOKENS[:12]))
    manager.free("a")  # blocks 1-3: cached and evictable
    prefill(manager, new_req(manager, "c", TOKENS[40:42]))  # takes 1 free block: 4 left
    manager.take_pending()
    req = new_req(manager, "b", TOKENS[:20])
    hit = manager.get_computed_blocks(req)
    assert hit.num_tokens == 12
    # 3 revived + 2 new > 4 free: nothing may move, not even the hit's reference counts.
    assert_fails_atomically(manager, req, 8, hit)
    assert manager.allocate_slots(req, 4, hit) is not None


def test_a_failed_step_still_releases_blocks_that_left_the_window():
    """By design `allocate_slots` drops blocks no future token can see before it counts what the
    step needs (that makes room), so they stay released even when the step does not fit."""
    manager = make_manager((full(4), 5), (sliding(4, 6), 16))
    req = new_req(manager, "a", TOKENS[:12])
    prefill(manager, req)  # blocks 1-3 in each group
    prefill(manager, new_req(manager, "hog", TOKENS[40:41]))  # the full group's last block
    before = snapshot(manager)
    assert decode(manager, req, 99) is None  # token 12 needs a 4th full-attention block
    assert manager.block_ids("a") == [[1, 2, 3], [0, 2, 3]]
    assert snapshot(manager)[0][0] == before[0][0]  # the full group is untouched
    assert manager.num_free_blocks() == [0, 16 - 1 - 3]
    manager.check_integrity()
