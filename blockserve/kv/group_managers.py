"""Per-group managers: each knows how one kind of layer uses its group's block table.

A request's table in a group is a list of blocks, entry i covering tokens
[i * block_size, (i + 1) * block_size). Sliding-window tables keep their length as blocks fall
out of the window: those entries become the null block. A linear-state table is one slot.

    full / MLA       [b3][b7][b1][b9]          hit: longest cached run from the left
    sliding window   [--][--][b1][b9]          hit: rightmost run covering the window
    linear state     [s4]                      hit: a state checkpoint (kv/state_manager.py)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from blockserve.kv.block_pool import Block, BlockPool
from blockserve.kv.hashing import BlockHash
from blockserve.kv.specs import KVCacheSpec, SlidingWindowSpec, cdiv


class FullAttentionManager:
    """Full attention and MLA: every token's KV stays until the request ends."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool):
        self.spec = spec
        self.pool = pool
        self.block_size = spec.block_size
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached: dict[str, int] = {}  # leading table entries already in the prefix cache

    def table_len(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def hit_tokens(self, hit: list[Block]) -> int:
        """Tokens a hit from `find_longest_hit` covers."""
        return len(hit) * self.block_size

    def find_longest_hit(self, hashes: list[BlockHash], max_tokens: int) -> list[Block]:
        """The cached blocks of the longest prefix of at most `max_tokens` tokens."""
        hit = []
        for block_hash in hashes[: max_tokens // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no future token can attend to (only sliding windows have any)."""

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, computed: Sequence[Block]) -> int:
        """Free blocks this group spends to hold `num_tokens` after taking the hit `computed`."""
        held = len(self.req_blocks.get(request_id, ()))
        new = max(0, self.table_len(num_tokens) - held - len(computed))
        revived = sum(1 for b in computed if b.ref_cnt == 0)  # leave the evictable queue
        return new + revived

    def add_computed_blocks(self, request_id: str, computed: Sequence[Block]) -> None:
        self.pool.touch(computed)
        self.req_blocks.setdefault(request_id, []).extend(computed)
        if computed:
            # A hit's blocks are in the cache already.
            self.num_cached[request_id] = len(self.req_blocks[request_id])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[Block]:
        blocks = self.req_blocks.setdefault(request_id, [])
        new = self.pool.get_new_blocks(max(0, self.table_len(num_tokens) - len(blocks)))
        blocks.extend(new)
        return new

    def steady_limits(self, request_id: str, num_computed_tokens: int) -> tuple[float, float]:
        """(tokens the request's table covers, computed count at which a block must be released):
        below both, a step needs no allocation and releases nothing."""
        return len(self.req_blocks.get(request_id, ())) * self.block_size, math.inf

    def next_cache_point(self, request_id: str) -> float:
        """The written-token count at which the request's next block becomes full."""
        return (self.num_cached.get(request_id, 0) + 1) * self.block_size

    def cache_blocks(self, request_id: str, hashes: list[BlockHash], num_tokens: int) -> None:
        """Register the full blocks among the first `num_tokens` tokens, whose KV is written."""
        start = self.num_cached.get(request_id, 0)
        end = min(num_tokens // self.block_size, len(hashes))
        if end <= start:
            return
        blocks = self.req_blocks[request_id]
        self.pool.cache(blocks[start:end], hashes[start:end])
        self.num_cached[request_id] = end

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (speculative decoding: slots of
        rejected drafts only; such blocks were never cached, as only written tokens are, C4)."""
        blocks = self.req_blocks.get(request_id)
        keep = self.table_len(num_tokens)
        if blocks and len(blocks) > keep:
            if keep < self.num_cached.get(request_id, 0):
                raise ValueError(f"request {request_id}: cannot trim cached blocks (keep {keep})")
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(tail))

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))


class SlidingWindowManager(FullAttentionManager):
    """A token attends to the last `sliding_window` tokens; older blocks return to the pool."""

    spec: SlidingWindowSpec

    def find_longest_hit(self, hashes: list[BlockHash], max_tokens: int) -> list[Block]:
        # Computing from position p needs the KV of tokens [p - window + 1, p): the last
        # `needed` blocks before p. Search from the right for such a run of cached blocks.
        needed = max(1, cdiv(self.spec.sliding_window - 1, self.block_size))
        run: list[Block] = []
        for i in range(min(max_tokens // self.block_size, len(hashes)) - 1, -1, -1):
            block = self.pool.lookup(hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == needed:
                return [self.pool.null_block] * i + run[::-1]
        return run[::-1]  # a cached run reaching the first block is a hit of its own

    def steady_limits(self, request_id: str, num_computed_tokens: int) -> tuple[float, float]:
        window, bs = self.spec.sliding_window, self.block_size
        released = self.spec.num_skipped_tokens(num_computed_tokens) // bs
        return len(self.req_blocks.get(request_id, ())) * bs, (released + 1) * bs + window - 1

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = self.spec.num_skipped_tokens(num_computed_tokens) // self.block_size
        null = self.pool.null_block
        freed = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # everything before was skipped earlier
            freed.append(blocks[i])
            blocks[i] = null
        self.pool.free(freed)


def make_attention_manager(spec: KVCacheSpec, pool: BlockPool) -> FullAttentionManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool)
    return FullAttentionManager(spec, pool)
