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
    # state (group 2): checkpoints into running slots; two blocks loaded in one order each
    for group_id, pairs in enumerate((((2, 3), (5, 1)), ((1, 4), (3, 2)), ((6, 2), (7, 1)), ((5, 1), (2, 6)))):
        payloads = [kv.block_bytes(group_id, source) for source, _ in pairs]
        assert all(len(p) == GROUPS[group_id].bytes_per_block == kv.block_nbytes(group_id) for p in payloads)
        expected = [[tensor.select(kv.block_dims[group_id], source).clone() for tensor in kv.tensors[group_id]]
                    for source, _ in pairs]
        kv.load_blocks(group_id, [(target, bytearray(p)) for (_, target), p in zip(pairs, payloads)])
        dim = kv.block_dims[group_id]
        for (_, target), blocks in zip(pairs, expected):
            for tensor, block in zip(kv.tensors[group_id], blocks):
                assert torch.equal(tensor.select(dim, target).view(torch.uint8), block.view(torch.uint8))
        target = pairs[0][1]
        with pytest.raises(ValueError, match="bytes"):
            kv.load_blocks(group_id, [(target, bytearray(payloads[0][:-2]))])
        with pytest.raises(ValueError, match="null block"):
            kv.load_blocks(group_id, [(0, bytearray(payloads[0]))])


def test_keys_and_values_of_different_dtypes_get_a_tensor_each():
    kv = KVCacheTensors(KVCacheConfig(GROUPS[3:]), device="cpu")
    k, v = kv.tensors[0]
    assert (k.dtype, k.shape, v.dtype, v.shape) == (torch.int8, (2, 7, 4, 2, 10), torch.uint8, (2, 7, 4, 2, 8))
    kv.poison_blocks(0, [2])
    cache = kv.layer_caches()["l"]
    assert cache.k_cache.data_ptr() == k[1].data_ptr() and cache.v_cache.data_ptr() == v[1].data_ptr()
    assert (v[:, 2, ..., :4] == 0xFF).all() and v[:, 2, ..., 4:].view(torch.float16).isnan().all()
    assert (k[:, 2, ..., :8].view(torch.uint8) == 0x80).all() and (k[:, 1] == 0).all()


def _resident_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_cpu_cache_reads_as_zeros_without_being_written():
    """On the CPU the cache comes from the OS's zero pages: every group's tensors read as zeros
    (C1's null block and fresh state slots), and 128 MiB of cache take memory only where written."""
    kv = KVCacheTensors(KVCacheConfig(GROUPS), device="cpu")
    assert all((tensor.view(torch.uint8) == 0).all() for tensors in kv.tensors for tensor in tensors)
    before = _resident_mib()
    big = KVCacheTensors(KVCacheConfig((KVCacheGroup(FullAttentionSpec(16, 8, 64), 1024, True, ("a", "b")),)),
                         device="cpu")
    (tensor,) = big.tensors[0]
    assert tensor.numel() * tensor.element_size() == 2 * 2 * 1025 * 16 * 8 * 64 * 4  # 128 MiB and the scratch block
    assert _resident_mib() - before < 16
    big.zero_blocks(0, [5])
    tensor[1, 0, 7].fill_(1.0)
    assert tensor.sum().item() == 16 * 8 * 64 and tensor[:, :, 5].abs().sum().item() == 0
    assert _resident_mib() - before < 16
