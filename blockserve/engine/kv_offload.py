"""The engine's second prefix-cache tier: built from EngineConfig, keyed by a model fingerprint.

The fingerprint names everything that decides a block's bytes: the weights' content, the model's
dtype, the KV groups (specs with their block size and KV dtype, and the layers in each), the
quantized matmul's activations and the tensor-parallel rank. Entries written under another
fingerprint are never read (kv/tiers/entry.py), so a different model, format or setting starts cold.

Under tensor parallelism every rank fingerprints its own shard ("rank r of N"), rank 0 gathers them
(distributed/executor.py) and its store keys a block by every rank's entry; each rank's own store
(`build_rank_store`) writes that rank's entries. A different tensor-parallel size never hits.
"""

from __future__ import annotations

import hashlib

import torch

from blockserve.engine.config import EngineConfig, parse_bytes
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.external_blocks import unsupported_groups
from blockserve.kv.tiers import DiskTier, HostMemoryTier, TieredKVStore

FINGERPRINT_VERSION = b"blockserve-kv-offload-1"


def weights_digest(model: torch.nn.Module) -> bytes:
    """sha256 over every tensor of the model's state dict: name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
            data = tensor.detach().contiguous().cpu()
            if data.numel():
                digest.update(data.view(-1).view(torch.uint8).numpy())
    return digest.digest()


def model_fingerprint(model: torch.nn.Module, config: EngineConfig, kv_config: KVCacheConfig, dtype: torch.dtype,
                      rank: int = 0, world_size: int = 1) -> bytes:
    layout = repr([(g.spec, g.layer_names) for g in kv_config.groups])
    quantized = f"{config.quantized_matmul}|{config.quantized_activations}"
    parts = (FINGERPRINT_VERSION, weights_digest(model), str(dtype).encode(), layout.encode(), quantized.encode(),
             f"rank {rank} of {world_size}".encode())
    return hashlib.sha256(b"\0".join(parts)).digest()


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


def rank_tiers(config: EngineConfig, kv_config: KVCacheConfig) -> tuple[list, int]:
    """A tensor-parallel rank > 0's tiers and writer-queue size (the directory probed): its store, once
    rank 0 has sent every rank's fingerprint, writes the rank's own entries of the save orders (rank 0
    reads them back for every hit); it reads nothing itself."""
    queue_bytes = _check_model(config, kv_config)
    return _tiers(config), queue_bytes
