"""Capacity planning: a memory budget becomes a pool size per group, each in its own units."""

import pytest

from blockserve.kv.capacity import plan_kv_cache, plan_with_proposer
from blockserve.kv.manager import KVCacheManager
from tests.kv.conftest import full, mla, sliding, state

MIB = 2**20


def total_bytes(config) -> int:
    return sum(g.num_blocks * g.bytes_per_block for g in config.groups)


def test_state_groups_get_one_slot_per_sequence_and_attention_groups_share_the_rest():
    groups = [(mla(16), ("m0", "m1"), False), (state(), ("s0", "s1", "s2"), False)]
    config = plan_kv_cache(groups, memory_bytes=4 * MIB, max_model_len=256, max_num_seqs=8)
    attention, linear = config.groups
    assert linear.num_blocks == 8 + 1 and linear.zero_new_blocks  # a state starts at zero
    assert not attention.zero_new_blocks and attention.layer_names == ("m0", "m1")
    assert total_bytes(config) <= 4 * MIB
    assert total_bytes(config) + attention.bytes_per_block > 4 * MIB  # nothing left unused
    assert KVCacheManager(config).never_fits(256) is None


def test_attention_groups_run_out_together():
    """Each group gets blocks in proportion to what one longest request holds in it."""
    groups = [(full(16), ("f",), True), (sliding(16, 64), ("s",), False)]
    config = plan_kv_cache(groups, 8 * MIB, max_model_len=1024, max_num_seqs=4, max_chunk_tokens=16)
    f, s = config.groups
    need_full, need_sliding = 1024 // 16, sliding(16, 64).max_blocks_held(1024, 16)
    assert (f.num_blocks - 1) / need_full == pytest.approx((s.num_blocks - 1) / need_sliding, rel=0.02)
    assert f.zero_new_blocks and not s.zero_new_blocks
    assert total_bytes(config) <= 8 * MIB
    assert KVCacheManager(config).never_fits(1024, max_chunk_tokens=16) is None


def test_the_smallest_budget_that_holds_one_request():
    groups = [(full(16), ("f",), False), (state(), ("s",), False)]
    per_block, per_slot = full(16).page_size_bytes, state().page_size_bytes
    minimum = 4 * per_block + (2 + 1) * per_slot + per_block  # 4 blocks, 3 slots, the null block
    config = plan_kv_cache(groups, minimum, max_model_len=64, max_num_seqs=2)
    assert config.groups[0].num_blocks == 5
    assert KVCacheManager(config).never_fits(64) is None
    with pytest.raises(ValueError, match="cannot hold even one request of max_model_len=64"):
        plan_kv_cache(groups, minimum - 1, max_model_len=64, max_num_seqs=2)


def test_config_options_pass_through():
    config = plan_kv_cache([(full(16), ("f",), False)], MIB, 64, 1, enable_prefix_caching=False)
    assert not config.enable_prefix_caching


def test_a_proposer_s_cache_is_drawn_from_the_model_s_budget():
    """A draft's groups planned beside a hybrid target's: one budget for both, the same tokens of one
    request in every attention group, the draft's prefix caching off and the target's options kept."""
    target = [(full(16), ("f",), False), (state(), ("s",), False)]
    draft = [(full(16), ("d0", "d1"), True)]
    options = dict(enable_prefix_caching=True, poison_freed_blocks=True, checkpoint_share=0.1)
    alone = plan_kv_cache(target, 4 * MIB, 256, 4, **options)
    model, proposer = plan_with_proposer(target, draft, 4 * MIB, 256, 4, **options)
    assert total_bytes(model) + total_bytes(proposer) <= 4 * MIB
    assert model.groups[0].num_blocks < alone.groups[0].num_blocks
    assert model.groups[0].num_blocks == proposer.groups[0].num_blocks  # equal block sizes: equal tokens
    assert model.groups[1].num_checkpoints > 0 and model.enable_prefix_caching and model.poison_freed_blocks
    assert proposer.groups[0].zero_new_blocks and proposer.groups[0].layer_names == ("d0", "d1")
    assert not proposer.enable_prefix_caching and proposer.poison_freed_blocks
    for config in (model, proposer):
        assert KVCacheManager(config).never_fits(256) is None
    caching = lambda **o: plan_with_proposer(target, draft, 4 * MIB, 256, 4, proposer_caching=True,  # noqa: E731
                                             **o)[1].enable_prefix_caching
    assert caching(**options)
    assert not caching(**options | dict(enable_prefix_caching=False))  # only where the model's is on


def test_a_budget_that_holds_the_model_alone_but_not_its_proposer_is_refused():
    target, draft = [(full(16), ("f",), False)], [(full(16), ("d",), False)]
    just_the_target = (256 // 16 + 1) * full(16).page_size_bytes
    assert plan_kv_cache(target, just_the_target, 256, 1).groups[0].num_blocks == 256 // 16 + 1
    with pytest.raises(ValueError, match="cannot hold even one request of max_model_len=256"):
        plan_with_proposer(target, draft, just_the_target, 256, 1)
