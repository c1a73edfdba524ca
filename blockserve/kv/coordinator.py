"""The groups of a (possibly hybrid) model, driven together.

A prefix hit must be valid for every group at once, and an allocation must succeed in every
group or in none. State groups take part through their checkpoints: a state group's hit at a
bound is its deepest checkpoint at or below it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from blockserve.kv.block_pool import Block, BlockPool
from blockserve.kv.checkpoint_pool import CheckpointPool
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.group_managers import make_attention_manager
from blockserve.kv.hashing import BlockHash
from blockserve.kv.pending import PendingWork
from blockserve.kv.state_manager import LinearStateManager

HashesFor = Callable[[int], list[BlockHash]]  # block size -> the request's full-block hashes


class KVCacheCoordinator:
    def __init__(self, config: KVCacheConfig, pending: PendingWork):
        self.config = config
        self.pools = [
            BlockPool(g.num_blocks, i, pending, g.zero_new_blocks, config.poison_freed_blocks)
            for i, g in enumerate(config.groups)
        ]
        stride = config.checkpoint_stride
        self.managers = []
        self.state_managers: list[LinearStateManager] = []
        for i, (group, pool) in enumerate(zip(config.groups, self.pools)):
            if group.is_state:
                checkpoints = None
                if config.checkpointing:
                    checkpoints = CheckpointPool(group.num_blocks, group.num_checkpoints, i, pending,
                                                 config.poison_freed_blocks, config.checkpoint_savings_weight)
                manager = LinearStateManager(group.spec, pool, checkpoints, stride, pending)
                self.state_managers.append(manager)
            else:
                manager = make_attention_manager(group.spec, pool)
            self.managers.append(manager)
        self.attention_managers = [m for m in self.managers if not isinstance(m, LinearStateManager)]
        if config.checkpointing:
            for manager in self.attention_managers:
                manager.pool.on_uncached = self._attention_block_uncached(manager.pool.group_id)
        # Per request, to skip the common steps that change nothing (most decode steps):
        # (tokens covered, computed count at which a block is released), the minimum over groups (see
        # FullAttentionManager.steady_limits): a step that holds at most the first and has computed less
        # than the second changes nothing (KVCacheManager.allocate_slots reads it).
        self.steady: dict[str, tuple[float, float]] = {}
        self.next_cache_at: dict[str, float] = {}  # written tokens at which some block fills up

    def _attention_block_uncached(self, group_id: int) -> Callable[[BlockHash], None]:
        def forget(block_hash: BlockHash) -> None:
            for manager in self.state_managers:
                manager.checkpoints.forget_attention_block(group_id, block_hash)
        return forget

    def find_longest_hit(self, hashes_for: HashesFor, max_tokens: int,
                         attention_only: bool = False) -> tuple[int, list[list]]:
        """The longest prefix of at most `max_tokens` tokens cached in every group (in every
        attention group, with `attention_only`; the state groups' hits are then empty).

        Each group's hit can only shrink when the bound shrinks, so shrinking the bound to the
        shortest group hit until no group disagrees reaches the longest common hit.
        """
        managers = self.attention_managers if attention_only else self.managers
        if not managers:
            return 0, [[] for _ in self.managers]
        bound = max(0, max_tokens)
        while True:
            hits = {}
            for manager in managers:
                hashes = hashes_for(manager.block_size) if manager.spec.supports_prefix_caching else []
                blocks = manager.find_longest_hit(hashes, bound)
                hits[manager] = blocks
                if manager.hit_tokens(blocks) < bound:
                    break
            shortest = min(m.hit_tokens(b) for m, b in hits.items())
            if len(managers) == 1 or shortest == bound or bound == 0:
                return shortest if len(managers) == 1 else bound, [hits.get(m, []) for m in self.managers]
            bound = shortest

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, computed: Sequence[Sequence]) -> list[int]:
        return [m.num_blocks_to_allocate(request_id, num_tokens, c) for m, c in zip(self.managers, computed)]

    def allocate(self, request_id: str, num_computed_tokens: int, num_tokens: int,
                 computed: Sequence[Sequence]) -> list[list[int]] | None:
        """Give the request blocks for `num_tokens` tokens in every group, or change nothing.
        A state group's hit (a checkpoint) becomes a copy order into its new running slot."""
        needed = self.num_blocks_to_allocate(request_id, num_tokens, computed)
        if any(n > pool.num_free for n, pool in zip(needed, self.pools)):
            return None
        new_ids = []
        for manager, hit in zip(self.managers, computed):
            if hit:  # (most allocations are a running request's next block, with no hit)
                manager.add_computed_blocks(request_id, hit)
            new = [b.block_id for b in manager.allocate_new_blocks(request_id, num_tokens)]
            if hit and not isinstance(manager, LinearStateManager):
                new = [b.block_id for b in hit] + new
            new_ids.append(new)
        limits = [m.steady_limits(request_id, num_computed_tokens) for m in self.managers]
        self.steady[request_id] = limits[0] if len(limits) == 1 else (min(c for c, _ in limits),
                                                                      min(r for _, r in limits))
        return new_ids

    def allocate_loaded(self, request_id: str, computed: Sequence[Sequence], num_tokens: int,
                        firsts: dict[int, int]) -> list[list[Block]]:
        """Take the hit `computed`, then blocks up to `num_tokens` tokens (whole blocks) that loads from
        the second tier fill: no zero order, since the load writes every slot before a kernel reads
        any (C1); cached only by `cache_blocks` after the step (C4). In a group of `firsts` (sliding
        windows) the table entries before block `firsts[group]` are the null block. The caller
        checked they fit."""
        loaded = []
        for group_id, (manager, hit) in enumerate(zip(self.managers, computed)):
            if hit:
                manager.add_computed_blocks(request_id, hit)
            blocks = manager.req_blocks.setdefault(request_id, [])
            first = firsts.get(group_id, 0)
            if first > len(blocks):  # out of the window: never read, never cached
                blocks.extend([manager.pool.null_block] * (first - len(blocks)))
                manager.num_cached[request_id] = first
            new = manager.pool.get_new_blocks(max(0, manager.table_len(num_tokens) - len(blocks)), zero=False)
            blocks.extend(new)
            loaded.append(new)
        return loaded

    def trim(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> None:
        """Attention groups give back the blocks past `num_tokens` tokens; state groups (one slot each)
        drop their captures past the `num_computed_tokens` computed ones (they follow rejected drafts)."""
        for manager in self.attention_managers:
            manager.trim(request_id, num_tokens)
        if self.state_managers:
            for manager in self.state_managers:
                manager.drop_captures(request_id, num_computed_tokens)
            self.next_cache_at[request_id] = min(m.next_cache_point(request_id) for m in self.managers)
        limits = [m.steady_limits(request_id, num_computed_tokens) for m in self.managers]
        self.steady[request_id] = (min(c for c, _ in limits), min(r for _, r in limits))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def capture(self, request_id: str, positions: list[int], is_decode: bool, verifying: bool = False) -> None:
        """Checkpoint every state group at `positions` during this step's forward (best effort);
        `verifying`: the step scores drafts, so its result may drop some of them."""
        first = None
        for manager in self.state_managers:
            taken = manager.capture(request_id, positions, is_decode, verifying)
            if taken:
                first = min(p for p, _ in taken) if first is None else min(first, *(p for p, _ in taken))
        if first is not None:
            self.next_cache_at[request_id] = min(self.next_cache_at.get(request_id, first), first)

    def cache_blocks(self, request_id: str, hashes_for: HashesFor, num_tokens: int) -> None:
        """Register newly full blocks and written checkpoints; callers may skip the call below
        `next_cache_at[request_id]`."""
        for manager in self.attention_managers:
            manager.cache_blocks(request_id, hashes_for(manager.block_size), num_tokens)
        if self.state_managers:
            def probes_at(position: int) -> tuple[tuple[int, BlockHash], ...]:
                return tuple((m.pool.group_id, hashes_for(m.block_size)[position // m.block_size - 1])
                             for m in self.attention_managers)
            for manager in self.state_managers:
                manager.commit_captures(request_id, hashes_for, num_tokens, probes_at)
        self.next_cache_at[request_id] = min(m.next_cache_point(request_id) for m in self.managers)

    def end_of_step_orders(self) -> None:
        for manager in self.state_managers:
            manager.end_of_step_orders()

    def free(self, request_id: str) -> None:
        self.steady.pop(request_id, None)
        self.next_cache_at.pop(request_id, None)
        for manager in self.managers:
            manager.free(request_id)

    def block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in m.req_blocks.get(request_id, ())] for m in self.managers]
