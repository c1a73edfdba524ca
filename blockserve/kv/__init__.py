"""The KV cache core: specs, block pools, prefix-cache hashing, per-group managers, coordinator.

Pure Python: this package never imports torch (a test enforces it).
"""

from blockserve.kv.block_pool import NULL_BLOCK_ID, ResetResult
from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.hashing import BlockHashChain
from blockserve.kv.manager import ComputedBlocks, KVCacheManager, KVRequest, PrefixCacheStats
from blockserve.kv.pending import PendingWork
from blockserve.kv.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    LinearStateSpec,
    MLASpec,
    SlidingWindowSpec,
    zero_new_blocks,
)

__all__ = [
    "NULL_BLOCK_ID",
    "BlockHashChain",
    "ComputedBlocks",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "KVRequest",
    "LinearStateSpec",
    "MLASpec",
    "PendingWork",
    "PrefixCacheStats",
    "ResetResult",
    "SlidingWindowSpec",
    "zero_new_blocks",
]
