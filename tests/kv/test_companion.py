"""A draft model's groups as the companion of the target's KVCacheManager: admitted, grown, trimmed
and freed with the target's, all or nothing; the companion's own hit on the request's hash chain; C3
across both; no sliding-window companion."""

from __future__ import annotations

import pytest

from blockserve.kv import KVCacheConfig, KVCacheGroup, KVCacheManager
from tests.kv.conftest import compute, decode, full, new_req, prefill, sliding, snapshot

TOKENS = list(range(2000, 2040))


def manager(target_blocks: int, draft_blocks: int, draft_spec=None, caching: bool = True,
            poison: bool = False) -> KVCacheManager:
    """A target over one full-attention group and its companion over one group of `draft_spec`."""
    def config(spec, num_blocks):
        return KVCacheConfig((KVCacheGroup(spec, num_blocks, True, ()),), enable_prefix_caching=caching,
                             poison_freed_blocks=poison)
    draft = KVCacheManager(config(draft_spec or full(4), draft_blocks))
    return KVCacheManager(config(full(4), target_blocks), companion=draft)


def held(kv: KVCacheManager, rid: str) -> tuple[list[int], list[int]]:
    """The request's block tables, the target's group and the companion's."""
    return kv.block_ids(rid)[0], kv.companion.block_ids(rid)[0]


def test_admission_and_every_step_cover_the_draft_s_groups_too():
    kv = manager(32, 32)
    req = new_req(kv, "a", TOKENS[:10])
    prefill(kv, req)
    target, draft = held(kv, "a")
    assert len(target) == len(draft) == 3
    for token in range(4):
        decode(kv, req, token)
    assert [len(t) for t in held(kv, "a")] == [4, 4]  # 14 tokens
    assert kv.companion.take_pending().blocks_to_zero == {0: held(kv, "a")[1]}  # the draft's runner zeroes its own
    kv.free("a")
    assert kv.companion.usage() == [0.0]
    kv.assert_idle()
    kv.companion.assert_idle()


def test_an_allocation_the_companion_cannot_hold_changes_nothing_in_either():
    kv = manager(32, 4)  # the draft's group: 3 blocks and the null block
    a = new_req(kv, "a", TOKENS[:12])
    prefill(kv, a)
    before = snapshot(kv), snapshot(kv.companion)
    b = new_req(kv, "b", TOKENS[20:25])
    assert kv.allocate_slots(b, 5, kv.get_computed_blocks(b)) is None
    assert decode(kv, a, 7) is None  # the 13th token needs a 4th draft block
    assert (snapshot(kv), snapshot(kv.companion)) == before
    kv.free("a")  # preempting the holder frees the draft's blocks with the target's
    assert prefill(kv, b)[1] is not None
    kv.check_integrity()
    kv.companion.check_integrity()


def test_trimmed_drafts_leave_both_groups():
    kv = manager(32, 32)
    req = new_req(kv, "a", TOKENS[:7])
    prefill(kv, req)
    req.token_ids.append(1)
    assert kv.allocate_slots(req, 1 + 5) is not None  # a token and 5 drafts: 13 slots
    assert [len(t) for t in held(kv, "a")] == [4, 4]
    req.num_computed_tokens += 2  # one draft accepted
    req.token_ids += [2, 3]
    kv.trim_slots(req, len(req.token_ids))  # 10 tokens
    assert [len(t) for t in held(kv, "a")] == [3, 3]
    kv.free("a")
    kv.assert_idle()


def test_reserving_a_step_s_drafts_covers_the_companion_alone():
    kv = manager(32, 5)  # the draft's group: 4 blocks
    req = new_req(kv, "a", TOKENS[:8])
    prefill(kv, req)
    req.token_ids.append(1)
    target = snapshot(kv)
    assert kv.reserve_companion(req, 1 + 3)  # rows 8..11: a third block
    assert snapshot(kv) == target and len(held(kv, "a")[1]) == 3
    assert kv.reserve_companion(req, 1 + 2)  # covered already
    assert not kv.reserve_companion(req, 1 + 8)  # 17 rows: a fifth block does not fit
    assert len(held(kv, "a")[1]) == 3
    kv.free("a")
    kv.companion.assert_idle()


def test_the_companion_s_hit_is_its_own_and_reaches_the_last_prompt_token():
    """The draft's cache hits on the blocks the draft cached, up to the whole prompt (it feeds the
    target's next token), whatever the target's cache holds."""
    kv = manager(32, 32)
    draft = kv.companion
    req = new_req(kv, "a", TOKENS[:8])
    prefill(kv, req)
    record = new_req(draft, "a", TOKENS[:8])  # the draft's rows, written as it proposes
    compute(draft, record, 8)
    kv.free("a")
    again = new_req(kv, "b", TOKENS[:8])
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 4 and hit.companion.num_tokens == 8  # the target leaves one token to compute
    kv.allocate_slots(again, 4, hit)
    assert draft.admitted_rows("b") == 8 and draft.admitted_rows("b") is None
    assert held(kv, "b")[1] == [b.block_id for b in hit.companion.blocks[0]]
    assert draft.prefix_cache_stats().hits == 8
    kv.free("b")
    kv.reset_prefix_cache()  # both caches
    assert kv.get_computed_blocks(new_req(kv, "c", TOKENS[:8])).companion is None


def test_c3_fails_when_the_companion_holds_a_request_the_target_does_not():
    kv = manager(32, 32)
    stray = new_req(kv.companion, "ghost", TOKENS[:4])
    kv.companion.allocate_slots(stray, 4)
    with pytest.raises(AssertionError, match="companion holds blocks of requests the target does not"):
        kv.check_integrity()


def test_a_manager_follows_one_manager_only_and_never_with_sliding_windows():
    kv = manager(8, 8)
    with pytest.raises(ValueError, match="companion"):
        KVCacheManager(kv.config, companion=kv.companion)
    with pytest.raises(ValueError, match="cannot be sliding windows"):
        manager(8, 8, sliding(4, 4))


def test_a_request_the_draft_s_groups_could_never_hold_is_refused_naming_them():
    kv = manager(32, 4)
    assert kv.never_fits(12) is None
    assert "(the draft model's)" in kv.never_fits(13)
