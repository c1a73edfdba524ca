"""A second tier for the prefix cache: host memory and disk behind the device pool (torch-free).

`TieredKVStore` (store.py) is what the KV manager and the worker talk to; `DiskTier` (disk.py) and
`HostMemoryTier` (memory.py) hold the entries; entry.py is their key and checksummed format.
"""

from blockserve.kv.tiers.disk import DiskTier, TierUnusable
from blockserve.kv.tiers.entry import CorruptEntry, entry_key
from blockserve.kv.tiers.memory import HostMemoryTier
from blockserve.kv.tiers.store import OffloadStats, TieredKVStore, TierStats, WriterCounts

__all__ = ["CorruptEntry", "DiskTier", "HostMemoryTier", "OffloadStats", "TierStats", "TierUnusable",
           "TieredKVStore", "WriterCounts", "entry_key"]
