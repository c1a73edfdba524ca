"""One group's blocks: reference counts, free queues and the prefix-cache map.

    block 0              the null block: never handed out, never freed
    uncached free list   free blocks holding no cached prefix; handed out first
    evictable LRU        free blocks still holding a cached prefix, least recently freed first;
                         one is evicted (its hash dropped) only when it is handed out again
    in use               ref_cnt > 0: held by that many requests

Every block is in exactly one of these. All operations are O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from blockserve.kv.hashing import BlockHash
from blockserve.kv.pending import PendingWork

NULL_BLOCK_ID = 0


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


@dataclass(frozen=True)
class ResetResult:
    ok: bool
    reason: str = ""


class BlockPool:
    """The blocks of one KV cache group.

    `zero_new_blocks` (C1) makes every block handed out by `get_new_blocks` a zero order in
    `pending`; blocks reused through a prefix-cache hit (`touch`) are not, since they hold
    exactly the KV the request needs. `poison_freed_blocks` (poison mode) makes every block
    whose content becomes garbage (freed uncached, or evicted from the cache) a poison order.
    """

    def __init__(self, num_blocks: int, group_id: int, pending: PendingWork, zero_new_blocks: bool,
                 poison_freed_blocks: bool = False):
        self.group_id = group_id
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # pinned: never counted as free
        self.capacity = num_blocks - 1
        self._pending = pending
        self._zero_new_blocks = zero_new_blocks
        self._poison = poison_freed_blocks
        # Popped from the end: low block ids are handed out first on a fresh pool.
        self._uncached: list[Block] = self.blocks[:0:-1]
        self._evictable: OrderedDict[int, Block] = OrderedDict()
        # A hash maps to every block holding that content: two requests that computed the same
        # prefix in the same step both register, so the survivor still serves hits.
        self.cached: dict[BlockHash, dict[int, Block]] = {}
        self.num_evictions = 0
        # Told the hash of every prefix this pool stops caching (the state checkpoints at its
        # position can no longer hit); set by the coordinator.
        self.on_uncached: Callable[[BlockHash], None] | None = None

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that `get_new_blocks` can hand out now (uncached + evictable)."""
        return len(self._uncached) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.capacity - self.num_free

    @property
    def usage(self) -> float:
        return self.num_in_use / self.capacity

    def lookup(self, block_hash: BlockHash) -> Block | None:
        twins = self.cached.get(block_hash)
        return next(iter(twins.values())) if twins else None

    # -- allocation ----------------------------------------------------------------------------

    def get_new_blocks(self, n: int, zero: bool = True) -> list[Block]:
        """Hand out `n` blocks with no cached content; the caller checked `num_free` first.
        `zero=False`: the caller fills them by a copy before any kernel reads them (C1)."""
        if n > self.num_free:
            raise RuntimeError(f"group {self.group_id}: asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._uncached:
                block = self._uncached.pop()
            else:
                _, block = self._evictable.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if self._zero_new_blocks and zero and out:
            self._pending.blocks_to_zero.setdefault(self.group_id, []).extend(b.block_id for b in out)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block of a prefix-cache hit."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the order given; pass a request's blocks tail
        first so that its deepest cached blocks are evicted before its shared prefix."""
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._uncached.append(block)
                    self._record_poison(block)
                else:
                    self._evictable[block.block_id] = block

    # -- prefix cache --------------------------------------------------------------------------

    def cache(self, blocks: Iterable[Block], hashes: Iterable[BlockHash]) -> None:
        """Register full blocks whose KV has been written under their prefix hashes (C4)."""
        for block, block_hash in zip(blocks, hashes):
            if block.block_hash is not None or block is self.null_block:
                continue
            block.block_hash = block_hash
            self.cached.setdefault(block_hash, {})[block.block_id] = block

    def _evict(self, block: Block) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        twins = self.cached[block_hash]
        del twins[block.block_id]
        block.block_hash = None
        self.num_evictions += 1
        self._record_poison(block)
        if not twins:
            del self.cached[block_hash]
            if self.on_uncached is not None:
                self.on_uncached(block_hash)

    def _record_poison(self, block: Block) -> None:
        if self._poison:
            self._pending.blocks_to_poison.setdefault(self.group_id, []).append(block.block_id)

    def reset_prefix_cache(self) -> ResetResult:
        """Forget every cached prefix; refused (and nothing changes) while any block is in use."""
        if self.num_in_use:
            return ResetResult(False, f"group {self.group_id}: {self.num_in_use} blocks are still in use by requests")
        for block in self._evictable.values():
            block.block_hash = None
            self._uncached.append(block)
            self._record_poison(block)
        self._evictable.clear()
        self.cached.clear()
        return ResetResult(True)

    # -- C3 ------------------------------------------------------------------------------------

    def check_integrity(self, holders: dict[int, int]) -> None:
        """Raise AssertionError unless the pool's books balance.

        `holders[block_id]` is how many requests hold that block, counted by the managers.
        """
        gid = self.group_id
        assert self.null_block.ref_cnt == 1 and self.null_block.block_hash is None, f"group {gid}: null block touched"
        uncached_ids = [b.block_id for b in self._uncached]
        free_ids = set(uncached_ids) | set(self._evictable)
        assert len(free_ids) == len(uncached_ids) + len(self._evictable), f"group {gid}: a block is queued twice"
        assert NULL_BLOCK_ID not in free_ids, f"group {gid}: null block in a free queue"
        for block in self.blocks[1:]:
            expected = holders.get(block.block_id, 0)
            assert block.ref_cnt == expected, (
                f"group {gid}: block {block.block_id} has ref_cnt {block.ref_cnt} but {expected} holders"
            )
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"group {gid}: block {block.block_id} (ref_cnt {block.ref_cnt}) is misplaced in the free queues"
            )
            if block.block_hash is not None:
                mapped = self.cached.get(block.block_hash, {}).get(block.block_id)
                assert mapped is block, f"group {gid}: block {block.block_id} hash unmapped"
        assert all(b.block_hash is None for b in self._uncached), f"group {gid}: cached block in the uncached list"
        assert all(b.block_hash is not None for b in self._evictable.values()), f"group {gid}: uncached evictable"
        for block_hash, twins in self.cached.items():
            assert twins, f"group {gid}: an empty entry in the prefix-cache map"
            for block in twins.values():
                assert block.block_hash == block_hash, f"group {gid}: map entry for block {block.block_id} is stale"
        in_use = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert len(self._uncached) + len(self._evictable) + in_use == self.capacity, (
            f"group {gid}: {len(self._uncached)} free + {len(self._evictable)} evictable + {in_use} in use "
            f"!= capacity {self.capacity}"
        )
