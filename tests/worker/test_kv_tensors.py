"""KVCacheTensors' second-tier payloads: a block copied out and loaded into another block comes back
bit for bit, in every layer and state component; a payload of the wrong size is refused."""

from __future__ import annotations

import pytest
import torch

from blockserve.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroup, LinearStateSpec, MLASpec
from blockserve.worker.kv_tensors import KVCacheTensors

GROUPS = (
    KVCacheGroup(FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16"), 6, True, ("a", "b")),
    KVCacheGroup(MLASpec(block_size=4, kv_lora_rank=16, qk_rope_head_dim=4), 6, True, ("m",)),
    KVCacheGroup(LinearStateSpec(shapes=((4, 3), (2, 8, 8)), dtypes=("float32", "float32")), 5, True, ("s", "t"), 3),
)


def test_a_block_round_trips_through_its_payload():
    kv = KVCacheTensors(KVCacheConfig(GROUPS), device="cpu")
    for tensors in kv.tensors:
        for tensor in tensors:
            tensor.copy_(torch.randn(tensor.shape))
    for group_id, (source, target) in enumerate(((2, 3), (1, 4), (6, 2))):  # state: a checkpoint into a running slot
        payload = kv.block_bytes(group_id, source)
        assert len(payload) == GROUPS[group_id].bytes_per_block == kv.block_nbytes(group_id)
        kv.load_blocks(group_id, [(target, bytearray(payload))])
        dim = kv.block_dims[group_id]
        for tensor in kv.tensors[group_id]:
            assert torch.equal(tensor.select(dim, source), tensor.select(dim, target))
        with pytest.raises(ValueError, match="bytes"):
            kv.load_blocks(group_id, [(target, bytearray(payload[:-2]))])
        with pytest.raises(ValueError, match="null block"):
            kv.load_blocks(group_id, [(0, bytearray(payload))])
