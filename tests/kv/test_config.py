"""The cache's shape: group validation, block sizes, and the start-up capacity report."""

import pytest

from blockserve.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroup, LinearStateSpec
from tests.kv.conftest import full, make_manager, mla, sliding, state


def test_a_group_needs_a_usable_block_besides_the_null_block():
    with pytest.raises(ValueError, match="null block"):
        KVCacheGroup(full(), num_blocks=1, zero_new_blocks=False)
    KVCacheGroup(full(), num_blocks=2, zero_new_blocks=False)


def test_a_cache_needs_a_group():
    with pytest.raises(ValueError):
        KVCacheConfig(())


def test_block_sizes_are_the_distinct_attention_sizes():
    config = make_manager((full(16), 4), (sliding(32), 4), (mla(16), 4), (state(), 4)).config
    assert config.block_sizes == (16, 32)


def test_bytes_per_block_counts_every_layer_of_the_group():
    group = KVCacheGroup(full(), 8, False, layer_names=("l0", "l1", "l2"))
    assert group.bytes_per_block == 3 * full().page_size_bytes


def test_capacity_report_states_each_group_in_its_own_units():
    attention = FullAttentionSpec(16, 8, 128, "bfloat16")  # 64 KiB per block per layer
    linear = LinearStateSpec(shapes=((1024, 256),), dtypes=("float32",))  # 1 MiB per slot per layer
    config = KVCacheConfig(
        (
            KVCacheGroup(attention, 1025, False, layer_names=("a0", "a1")),
            KVCacheGroup(linear, 9, True, layer_names=("m0", "m1", "m2", "m3")),
        )
    )
    lines = config.capacity_report().splitlines()
    assert lines == [
        "group 0 FullAttentionSpec (2 layers): 1024 blocks x 16 = 16384 tokens, 128.1 MiB, zero new blocks: no",
        "group 1 LinearStateSpec (4 layers): 8 state slots, 36.0 MiB, zero new blocks: yes",
        "KV cache total: 164.1 MiB",
    ]
    assert make_manager((attention, 1025)).capacity_report().startswith("group 0 FullAttentionSpec")


def test_capacity_report_compares_a_quantized_cache_with_float16():
    """int8: 64 codes + a 2-byte scale per head vector, against 128 bytes of float16."""
    spec = FullAttentionSpec(16, 2, 64, "int8")
    assert spec.page_size_bytes == 2 * 16 * 2 * 66
    config = KVCacheConfig((KVCacheGroup(spec, 101, False, layer_names=("a0", "a1")),))
    assert config.capacity_report().splitlines()[0] == (
        "group 0 FullAttentionSpec (2 layers): 100 blocks x 16 = 1600 tokens of int8 (2,033,602 tokens per GiB, "
        "1.94x float16), 0.8 MiB, zero new blocks: no")
