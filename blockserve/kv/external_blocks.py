"""Blocks whose KV comes from outside the device pool: the second tier (kv/tiers/) behind the
prefix cache, seen by the KV manager.

On admission, after the device pool's hit:

    device hit       [b3][b7]                        touched, as always
    external         [  ][  ][l1][l2][l3]            num_external_tokens: what the tiers hold next
    new              [  ][  ][  ][  ][  ][n1]        computed by the step

`allocate` takes the hit, reads and verifies the external blocks, allocates a device block for each
one that passed (no zero order: its load order writes every slot first, C1) and queues its load
order (C2); the rest of the prompt, from the first block that failed, gets ordinary new blocks and
is computed again. Loaded blocks enter the prefix cache like computed ones, after the step (C4).
After `cache_blocks`, each block newly cached gets a save order unless the tiers hold it already.

Tiers serve full-attention and MLA groups; sliding-window and recurrent-state groups have no
external blocks (the engine refuses tiers for such models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from blockserve.kv.config import KVCacheConfig
from blockserve.kv.coordinator import KVCacheCoordinator
from blockserve.kv.pending import PendingWork
from blockserve.kv.specs import FullAttentionSpec, MLASpec, SlidingWindowSpec
from blockserve.kv.tiers.store import TieredKVStore


def unsupported_groups(config: KVCacheConfig) -> list[str]:
    """The groups a second tier cannot serve, described (empty: every group can be)."""
    return [f"group {i} ({type(g.spec).__name__})" for i, g in enumerate(config.groups)
            if isinstance(g.spec, SlidingWindowSpec) or not isinstance(g.spec, (FullAttentionSpec, MLASpec))]


class ExternalBlocks:
    def __init__(self, config: KVCacheConfig, coordinator: KVCacheCoordinator, pending: PendingWork,
                 store: TieredKVStore):
        if bad := unsupported_groups(config):
            raise ValueError("a second prefix-cache tier serves full-attention and MLA KV only; this model also "
                             f"has {', '.join(bad)}: run it without --kv-offload-dir / --kv-offload-memory")
        self.store = store
        self.coordinator = coordinator
        self.pending = pending
        self.block_sizes = [g.spec.block_size for g in config.groups]
        self.unit = math.lcm(*self.block_sizes)  # an external run ends on a block boundary in every group
        self.num_loaded_tokens = 0  # cumulative: prompt tokens whose KV a tier supplied

    def _keys(self, request, group_id: int, start: int, end: int) -> list[bytes]:
        bs = self.block_sizes[group_id]
        hashes = request.block_hashes.get(bs, request.token_ids)
        return [self.store.key(group_id, h) for h in hashes[start // bs : end // bs]]

    def num_external_tokens(self, request, num_computed: int) -> int:
        """Tokens past the device hit's `num_computed` that the tiers hold, leaving one to compute."""
        bound = (len(request.token_ids) - 1) // self.unit * self.unit
        if num_computed % self.unit or bound <= num_computed:
            return 0
        end = bound
        for group_id, bs in enumerate(self.block_sizes):
            held = self.store.num_held(self._keys(request, group_id, num_computed, end))
            end = min(end, num_computed + held * bs)
        return (end - num_computed) // self.unit * self.unit

    def allocate(self, request, computed, num_external: int, num_tokens: int) -> int | None:
        """Blocks for `num_tokens` tokens (the hit `computed`, `num_external` external ones, then new
        ones) in every group, or None (nothing read, nothing changed) when they do not fit. Returns the
        tokens loaded: the external ones up to the first block that failed its read or check."""
        rid, start = request.request_id, computed.num_tokens
        needed = self.coordinator.num_blocks_to_allocate(rid, num_tokens, computed.blocks)
        if any(n > pool.num_free for n, pool in zip(needed, self.coordinator.pools)):
            return None
        end = start + num_external
        payloads = []
        for group_id, bs in enumerate(self.block_sizes):
            payloads.append(self.store.load(self._keys(request, group_id, start, end)))
            end = min(end, start + len(payloads[-1]) * bs)
        end = start + (end - start) // self.unit * self.unit
        loaded = self.coordinator.allocate_loaded(rid, computed.blocks, end)
        for group_id, (blocks, group_payloads) in enumerate(zip(loaded, payloads)):
            if blocks:
                self.pending.blocks_to_load.setdefault(group_id, []).extend(
                    (b.block_id, p) for b, p in zip(blocks, group_payloads))
        no_hit = tuple(() for _ in self.block_sizes)
        if self.coordinator.allocate(rid, end, num_tokens, no_hit) is None:
            raise AssertionError(f"request {rid}: blocks checked free ran out during allocation")
        self.num_loaded_tokens += end - start
        return end - start

    def order_saves(self, request, cached_before: Sequence[int]) -> None:
        """Save orders for the blocks `cache_blocks` just cached (each group's count before it was
        `cached_before[group]`) that the tiers do not hold yet."""
        rid = request.request_id
        for group_id, (manager, before) in enumerate(zip(self.coordinator.managers, cached_before)):
            after = manager.num_cached.get(rid, 0)
            if after <= before:
                continue
            bs = self.block_sizes[group_id]
            hashes = request.block_hashes.get(bs, request.token_ids)
            blocks = manager.req_blocks[rid]
            for i in range(before, after):
                key = self.store.key(group_id, hashes[i])
                if self.store.claim(key):
                    self.pending.blocks_to_save.setdefault(group_id, []).append((blocks[i].block_id, key))
