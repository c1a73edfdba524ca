"""The engine's second prefix-cache tier: built from EngineConfig, keyed by a model fingerprint
(worker/kv_fingerprint.py: weights, dtype, KV layout, quantized matmul, tensor-parallel rank and size).

Under tensor parallelism every rank fingerprints its own shard ("rank r of N"), rank 0 gathers them
(distributed/executor.py) and its store keys a block by every rank's entry; each rank's own store
(distributed/worker.py, with `offload_sizes`) writes that rank's entries. A different tensor-parallel
size never hits.
"""

from __future__ import annotations

import torch

from blockserve.engine.config import EngineConfig, parse_bytes
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.external_blocks import unsupported_groups
from blockserve.kv.tiers import DiskTier, HostMemoryTier, TieredKVStore
from blockserve.worker.kv_fingerprint import FINGERPRINT_VERSION, model_fingerprint, weights_digest

__all__ = ["FINGERPRINT_VERSION", "build_kv_offload", "model_fingerprint", "offload_sizes", "weights_digest"]


def _check_model(config: EngineConfig, kv_config: KVCacheConfig) -> int:
    """The writer queue's size in bytes; ValueError if this model's KV cannot use a tier."""
    if bad := unsupported_groups(kv_config):
        raise ValueError("--kv-offload-dir / --kv-offload-memory serve attention, MLA and recurrent-state "
                         f"groups only; this model also has {', '.join(bad)}: run it without them")
    queue_bytes = parse_bytes(config.kv_offload_queue, "kv_offload_queue")
    largest = max(g.bytes_per_block for g in kv_config.groups)
    if queue_bytes < largest:
        raise ValueError(f"kv_offload_queue ({config.kv_offload_queue}) is smaller than one block of this model's KV "
                         f"({largest} bytes), so nothing would ever be saved: give at least {largest} bytes")
    return queue_bytes


def _tiers(config: EngineConfig) -> list:
    tiers = []
    if config.kv_offload_memory is not None:
        tiers.append(HostMemoryTier(parse_bytes(config.kv_offload_memory, "kv_offload_memory")))
    if config.kv_offload_dir is not None:
        tiers.append(DiskTier(config.kv_offload_dir, parse_bytes(config.kv_offload_size, "kv_offload_size")))
    return tiers


def build_kv_offload(config: EngineConfig, kv_config: KVCacheConfig, model: torch.nn.Module,
                     dtype: torch.dtype, rank_fingerprints: tuple[bytes, ...] | None = None) -> TieredKVStore | None:
    """The tiers `config` asks for (None: none); ValueError, saying what to change, if this model's KV
    cannot use them or the directory cannot be written. `rank_fingerprints`: under tensor parallelism,
    every rank's fingerprint (rank 0's store, which schedules: it reads every rank's entries)."""
    if not config.kv_offload_enabled:
        return None
    queue_bytes = _check_model(config, kv_config)
    fingerprint = rank_fingerprints or model_fingerprint(model, config, kv_config, dtype)
    return TieredKVStore(_tiers(config), fingerprint, queue_bytes)


def offload_sizes(config: EngineConfig, kv_config: KVCacheConfig) -> tuple[int, int]:
    """(the writer queue's bytes, the disk tier's cap in bytes), checked for this model's KV: what a
    tensor-parallel rank > 0 builds its store with (its tiers: the disk tier alone)."""
    return _check_model(config, kv_config), parse_bytes(config.kv_offload_size, "kv_offload_size")
