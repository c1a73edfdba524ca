"""KVCacheTensors' second-tier payloads: a block copied out and loaded into another block comes back
bit for bit, in every layer and state component (K and V in their own tensors when their dtypes
differ); a payload of the wrong size is refused."""

from __future__ import annotations

import pytest
import torch

from blockserve.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroup, LinearStateSpec, MLASpec
from blockserve.worker.kv_tensors import KVCacheTensors

GROUPS = (
    KVCacheGroup(FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16"), 6, True, ("a", "b")),
    KVCacheGroup(MLASpec(block_size=4, kv_lora_rank=16, qk_rope_head_dim=4), 6, True, ("m",)),
    KVCacheGroup(LinearStateSpec(shapes=((4, 3), (2, 8, 8)), dtypes=("float32", "float32")), 5, True, ("s", "t"), 3),
    KVCacheGroup(FullAttentionSpec(4, 2, 8, dtype="int8", v_dtype="int4_rotated"), 6, True, ("k", "l")),  # K, V apart
)


def test_a_block_round_trips_through_its_payload():
    kv = KVCacheTensors(KVCacheConfig(GROUPS), device="cpu")
    for tensors in kv.tensors:
        for tensor in tensors:
            tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
    # state (group 2): a checkpoint into a running slot
    for group_id, (source, target) in enumerate(((2, 3), (1, 4), (6, 2), (5, 1))):
        payload = kv.block_bytes(group_id, source)
        assert len(payload) == GROUPS[group_id].bytes_per_block == kv.block_nbytes(group_id)
        kv.load_blocks(group_id, [(target, bytearray(payload))])
        dim = kv.block_dims[group_id]
        for tensor in kv.tensors[group_id]:
            source_bytes, target_bytes = (tensor.select(dim, b).view(torch.uint8) for b in (source, target))
            assert torch.equal(source_bytes, target_bytes)
        with pytest.raises(ValueError, match="bytes"):
            kv.load_blocks(group_id, [(target, bytearray(payload[:-2]))])
        with pytest.raises(ValueError, match="null block"):
            kv.load_blocks(group_id, [(0, bytearray(payload))])


def test_keys_and_values_of_different_dtypes_get_a_tensor_each():
    kv = KVCacheTensors(KVCacheConfig(GROUPS[3:]), device="cpu")
    k, v = kv.tensors[0]
    assert (k.dtype, k.shape, v.dtype, v.shape) == (torch.int8, (2, 7, 4, 2, 10), torch.uint8, (2, 7, 4, 2, 8))
    kv.poison_blocks(0, [2])
    cache = kv.layer_caches()["l"]
    assert cache.k_cache.data_ptr() == k[1].data_ptr() and cache.v_cache.data_ptr() == v[1].data_ptr()
    assert (v[:, 2, ..., :4] == 0xFF).all() and v[:, 2, ..., 4:].view(torch.float16).isnan().all()
    assert (k[:, 2, ..., :8].view(torch.uint8) == 0x80).all() and (k[:, 1] == 0).all()
