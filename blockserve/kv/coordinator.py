"""The groups of a (possibly hybrid) model, driven together.

A prefix hit must be valid for every group at once, and an allocation must succeed in every
group or in none.
"""

from __future__ import annotations

from collections.abc import Callable

from blockserve.kv.block_pool import Block, BlockPool
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.group_managers import FullAttentionManager, make_group_manager
from blockserve.kv.hashing import BlockHash
from blockserve.kv.pending import PendingWork

HashesFor = Callable[[int], list[BlockHash]]  # block size -> the request's full-block hashes


class KVCacheCoordinator:
    def __init__(self, config: KVCacheConfig, pending: PendingWork):
        self.config = config
        self.pools = [
            BlockPool(g.num_blocks, i, pending, g.zero_new_blocks, config.poison_freed_blocks)
            for i, g in enumerate(config.groups)
        ]
        self.managers: list[FullAttentionManager] = [
            make_group_manager(g.spec, pool) for g, pool in zip(config.groups, self.pools)
        ]
        # Per request, to skip the common steps that change nothing (most decode steps):
        self.steady: dict[str, tuple[float, float]] = {}  # see FullAttentionManager.steady_limits
        self.next_cache_at: dict[str, float] = {}  # written tokens at which some block fills up

    def find_longest_hit(self, hashes_for: HashesFor, max_tokens: int) -> tuple[int, list[list[Block]]]:
        """The longest prefix of at most `max_tokens` tokens cached in every group.

        Each group's hit can only shrink when the bound shrinks, so shrinking the bound to the
        shortest group hit until no group disagrees reaches the longest common hit.
        """
        bound = max(0, max_tokens)
        while True:
            hits = []
            for manager in self.managers:
                hashes = hashes_for(manager.block_size) if manager.spec.supports_prefix_caching else []
                blocks = manager.find_longest_hit(hashes, bound)
                hits.append(blocks)
                if len(blocks) * manager.block_size < bound:
                    break
            shortest = min(len(b) * m.block_size for b, m in zip(hits, self.managers))
            if len(self.managers) == 1:
                return shortest, hits  # nobody to disagree with
            if shortest == bound or bound == 0:
                return bound, hits
            bound = shortest

    def is_steady(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> bool:
        """True if holding `num_tokens` needs no new block and releases none in any group."""
        limits = self.steady.get(request_id)
        return limits is not None and num_tokens <= limits[0] and num_computed_tokens < limits[1]

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, computed: list[list[Block]]) -> list[int]:
        return [m.num_blocks_to_allocate(request_id, num_tokens, c) for m, c in zip(self.managers, computed)]

    def allocate(self, request_id: str, num_computed_tokens: int, num_tokens: int,
                 computed: list[list[Block]]) -> list[list[int]] | None:
        """Give the request blocks for `num_tokens` tokens in every group, or change nothing."""
        needed = self.num_blocks_to_allocate(request_id, num_tokens, computed)
        if any(n > pool.num_free for n, pool in zip(needed, self.pools)):
            return None
        new_ids = []
        for manager, hit in zip(self.managers, computed):
            manager.add_computed_blocks(request_id, hit)
            new = manager.allocate_new_blocks(request_id, num_tokens)
            new_ids.append([b.block_id for b in hit] + [b.block_id for b in new])
        limits = [m.steady_limits(request_id, num_computed_tokens) for m in self.managers]
        self.steady[request_id] = (min(c for c, _ in limits), min(r for _, r in limits))
        return new_ids

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def cache_blocks(self, request_id: str, hashes_for: HashesFor, num_tokens: int) -> None:
        """Register newly full blocks; callers may skip the call below `next_cache_at[request_id]`."""
        for manager in self.managers:
            if manager.spec.supports_prefix_caching:
                manager.cache_blocks(request_id, hashes_for(manager.block_size), num_tokens)
        self.next_cache_at[request_id] = min(m.next_cache_point(request_id) for m in self.managers)

    def free(self, request_id: str) -> None:
        self.steady.pop(request_id, None)
        self.next_cache_at.pop(request_id, None)
        for manager in self.managers:
            manager.free(request_id)

    def block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in m.req_blocks.get(request_id, ())] for m in self.managers]
