"""Shared helpers for the KV core tests: small specs, a request stand-in, and state snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from blockserve.kv import (
    BlockHashChain,
    ComputedBlocks,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheManager,
    LinearStateSpec,
    MLASpec,
    SlidingWindowSpec,
)
from blockserve.kv.block_pool import Block


def full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, num_kv_heads=1, head_size=8)


def sliding(block_size: int = 4, window: int = 6) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, num_kv_heads=1, head_size=8, sliding_window=window)


def mla(block_size: int = 4) -> MLASpec:
    return MLASpec(block_size, kv_lora_rank=16, qk_rope_head_dim=4)


def state(starts_zeroed: bool = True) -> LinearStateSpec:
    return LinearStateSpec(shapes=((3, 8), (2, 4, 4)), dtypes=("float32", "float32"), starts_zeroed=starts_zeroed)


def make_manager(*groups: tuple, caching: bool = True, poison: bool = False) -> KVCacheManager:
    """A manager over `(spec, num_blocks)`, `(spec, num_blocks, zero_new_blocks)` or, for a
    state group, `(spec, num_blocks, zero_new_blocks, num_checkpoints)` groups."""
    return KVCacheManager(
        KVCacheConfig(
            tuple(KVCacheGroup(g[0], g[1], g[2] if len(g) > 2 else False, (), g[3] if len(g) > 3 else 0)
                  for g in groups),
            enable_prefix_caching=caching,
            poison_freed_blocks=poison,
        )
    )


@dataclass
class Req:
    """The minimal `KVRequest` the manager needs."""

    request_id: str
    token_ids: list[int]
    block_hashes: BlockHashChain
    num_computed_tokens: int = 0


def new_req(manager: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> Req:
    return Req(rid, list(tokens), manager.new_block_hashes(salt))


def compute(manager: KVCacheManager, req: Req, num_tokens: int) -> None:
    """Pretend the forward pass wrote KV for `num_tokens` more tokens, and cache full blocks (C4)."""
    req.num_computed_tokens += num_tokens
    manager.cache_blocks(req, req.num_computed_tokens)


def prefill(manager: KVCacheManager, req: Req) -> tuple[ComputedBlocks, list[list[int]] | None]:
    """Admit `req` the way the scheduler does: take its prefix hit, allocate and compute the rest."""
    hit = manager.get_computed_blocks(req)
    ids = manager.allocate_slots(req, len(req.token_ids) - hit.num_tokens, hit)
    if ids is not None:
        compute(manager, req, len(req.token_ids) - req.num_computed_tokens)
    return hit, ids


def decode(manager: KVCacheManager, req: Req, token: int) -> list[list[int]] | None:
    """One decode step: append a token, allocate its slot, compute it."""
    req.token_ids.append(token)
    ids = manager.allocate_slots(req, 1)
    if ids is not None:
        compute(manager, req, 1)
    return ids


def hit_ids(hit: ComputedBlocks) -> list[list[int]]:
    """Per group, the block ids a hit hands out (none for a state group: it restores a checkpoint)."""
    return [[b.block_id for b in group] if group and isinstance(group[0], Block) else [] for group in hit.blocks]


def snapshot(manager: KVCacheManager) -> tuple:
    """Everything observable about the manager's books, to compare before and after an operation."""
    coordinator = manager.coordinator
    pools = tuple(
        (
            tuple((b.ref_cnt, b.block_hash) for b in pool.blocks),
            tuple(b.block_id for b in pool._uncached),
            tuple(pool._evictable),
            tuple(sorted((h, i) for h, twins in pool.cached.items() for i in twins)),
            pool.num_evictions,
        )
        for pool in coordinator.pools
    )
    tables = tuple(
        (
            {rid: tuple(b.block_id for b in blocks) for rid, blocks in m.req_blocks.items()},
            dict(m.num_cached),
        )
        for m in coordinator.managers
    )
    pending = manager._pending
    orders = tuple({g: tuple(ids) for g, ids in d.items()} for d in (pending.blocks_to_zero, pending.blocks_to_poison))
    return pools, tables, orders


def plant(pool, hashes: list[bytes], positions) -> dict[int, object]:
    """Put evictable cached blocks into `pool` for the chain positions given: {position: block}."""
    positions = sorted(positions)
    blocks = pool.get_new_blocks(len(positions))
    pool.cache(blocks, [hashes[p] for p in positions])
    pool.free(blocks)
    return dict(zip(positions, blocks))
