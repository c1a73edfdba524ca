"""KVCacheManager: the scheduler's one door into the KV cache.

Per step, for each request the scheduler
  1. on admission, asks `get_computed_blocks(request)` for its prefix-cache hit;
  2. calls `allocate_slots(request, n, hit)`: blocks for n more tokens in every group, or None
     (and nothing changed) when they do not fit;
  3. calls `plan_captures(request, start, n)` for each request it schedules, so models with
     recurrent state checkpoint it where later requests can hit;
  4. after the forward pass, calls `cache_blocks(request, num_computed_tokens)` so full blocks
     whose KV is now written, and the checkpoints it captured, become prefix-cache entries (C4);
  5. calls `free(request)` when it finishes, is preempted or aborted (`trim_slots` when a
     speculative step's drafts were rejected);
and once per `schedule()` it calls `take_pending()` for the zero, poison, copy and capture
orders, and the second tier's save and load orders (C2).

With a second tier (`offload`, kv/tiers/), admission asks `num_external_tokens(request, hit)` after
the device hit and, when the tiers hold more, allocates through `allocate_external_computed_blocks`
instead of `allocate_slots` (kv/external_blocks.py).

A draft model's groups are a *companion* manager of the target's (`companion`): every allocation of
the target's covers the same positions in the companion's groups too, all or nothing, so a request is
admitted, preempted and freed with its draft's blocks; `trim_slots` and `free` act on both, and a hit
carries the companion's own hit, on the same salted hash chain. `reserve_companion` covers a step's
drafts in the companion before the draft writes them. The draft writes only the rows it feeds, on
demand, so it caches (`cache_blocks`) and captures (`plan_captures`) by its own rows, and a companion
has no sliding-window group (whose blocks would be held back to the draft's rows, past the window
they were planned for); its zero, poison, copy and capture orders go to its own runner
(`take_pending` on the companion).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from blockserve.kv.block_pool import ResetResult
from blockserve.kv.checkpoint_policy import CapturePlan
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.coordinator import KVCacheCoordinator
from blockserve.kv.external_blocks import ExternalBlocks
from blockserve.kv.hashing import BlockHashChain
from blockserve.kv.pending import PendingWork
from blockserve.kv.specs import SlidingWindowSpec
from blockserve.kv.tiers.store import OffloadStats, TieredKVStore


class KVRequest(Protocol):
    """What the KV cache needs to know about a request."""

    request_id: str
    token_ids: Sequence[int]  # prompt and output so far; only ever grows
    num_computed_tokens: int  # tokens whose KV has been written
    block_hashes: BlockHashChain


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache hit: `num_tokens` tokens whose KV already sits in `blocks[group]` (for a
    state group, the checkpoint its running slot is restored from).

    `attention_tokens` is the hit the attention groups alone had: the tokens beyond
    `num_tokens` were lost because no state checkpoint reached them.
    """

    num_tokens: int
    blocks: tuple[tuple, ...]
    attention_tokens: int = 0
    companion: ComputedBlocks | None = None  # the companion's own hit (a draft model's groups)

    @property
    def state_lost_tokens(self) -> int:
        return max(0, self.attention_tokens - self.num_tokens)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative since start-up: requests looked up, prompt tokens queried, tokens hit, tokens
    lost because attention blocks were cached but no state checkpoint was, and the checkpoint
    pools' captures, restores and evictions (evictions counts attention blocks' too)."""

    requests: int
    queries: int
    hits: int
    evictions: int
    state_lost_tokens: int = 0
    checkpoint_captures: int = 0
    checkpoint_restores: int = 0
    tier_hits: int = 0  # of `hits`, the tokens a second tier supplied

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, offload: TieredKVStore | None = None,
                 companion: KVCacheManager | None = None):
        """`offload`: a second tier behind the prefix cache (ValueError if this model's groups cannot
        use one; ignored, like the device cache, with prefix caching off). `companion`: a draft model's
        manager, allocated with this one (see the module)."""
        if companion is not None:
            if companion.companion is not None or companion.allocated_by is not None:
                raise ValueError("a companion KV cache manager follows one manager and has no companion of its own")
            if windows := [i for i, g in enumerate(companion.config.groups) if isinstance(g.spec, SlidingWindowSpec)]:
                # Its rows lag the target's (it feeds on demand): such a group would hold every block back to
                # them, past the window it was planned for.
                raise ValueError(f"a companion's groups cannot be sliding windows (group {windows[0]})")
        self.config = config
        self.companion = companion
        self.allocated_by: KVCacheManager | None = None  # as a companion: the manager it follows
        if companion is not None:
            companion.allocated_by = self
        self._admitted_rows: dict[str, int] = {}  # as a companion: the hit of a request's admission, until taken
        self.enable_caching = config.enable_prefix_caching and any(
            g.spec.supports_prefix_caching for g in config.groups
        )
        has_state = any(g.is_state for g in config.groups)
        # A model with a state group hits only through checkpoints: none fit, no hits.
        self.caching_possible = self.enable_caching and (config.checkpointing or not has_state)
        self.checkpointing = self.caching_possible and has_state
        self.stride = config.checkpoint_stride
        self._pending = PendingWork()
        self.coordinator = KVCacheCoordinator(config, self._pending)
        self._no_hit = ComputedBlocks(0, tuple(() for _ in config.groups))
        self._nothing_new = tuple(() for _ in config.groups)  # what a steady step appends, shared
        self._steady = self.coordinator.steady
        self._plans: dict[str, CapturePlan] = {}
        self._requests = self._queries = self._hits = self._state_lost = 0
        self.external = None  # the second tier, seen as external blocks
        if offload is not None and self.caching_possible:
            self.external = ExternalBlocks(config, self.coordinator, self._pending, offload)

    def new_block_hashes(self, cache_salt: str | None = None) -> BlockHashChain:
        """The hash chain a new request carries (one list per attention block size, and one
        at the checkpoint stride for models with recurrent state)."""
        sizes = self.config.hash_block_sizes
        if self.companion is not None:
            sizes = tuple(sorted({*sizes, *self.companion.config.hash_block_sizes}))
        return BlockHashChain(sizes, cache_salt)

    # -- the request-level API -----------------------------------------------------------------

    def get_computed_blocks(self, request: KVRequest) -> ComputedBlocks:
        """The longest prefix of `request` cached in every group, leaving one token to compute; with a
        companion, also the companion's longest, which may hold every token: the draft feeds the target's
        next one before it drafts."""
        hit = self._longest_hit(request, len(request.token_ids) - 1)
        companion = self.companion
        if companion is not None and companion.caching_possible:
            companion_hit = companion._longest_hit(request, len(request.token_ids))
            if companion_hit.num_tokens:
                hit = dataclasses.replace(hit, companion=companion_hit)
        return hit

    def _longest_hit(self, request: KVRequest, bound: int) -> ComputedBlocks:
        """The longest prefix of at most `bound` tokens of `request` cached in every group."""
        if not self.caching_possible:
            return self._no_hit
        hashes_for = lambda bs: request.block_hashes.get(bs, request.token_ids)  # noqa: E731
        num_tokens, hits = self.coordinator.find_longest_hit(hashes_for, bound)
        attention_tokens = num_tokens
        if self.checkpointing:
            attention_tokens = self.coordinator.find_longest_hit(hashes_for, bound, attention_only=True)[0]
        if num_tokens == 0 and attention_tokens == 0:
            return self._no_hit
        return ComputedBlocks(num_tokens, tuple(tuple(h) for h in hits), attention_tokens)

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> Sequence[Sequence[int]] | None:
        """Blocks for `num_new_tokens` more tokens in every group.

        Returns, per group, the block ids appended to the request's table (a hit's blocks
        first), or None if some group (a companion's included) lacks free blocks, in which case
        nothing was allocated. Call right after `get_computed_blocks` so the hit's blocks cannot be
        evicted between.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"allocate_slots needs num_new_tokens > 0, got {num_new_tokens}")
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        num_tokens = num_computed + num_new_tokens
        companion = self.companion
        if computed is None:
            # Most decode steps need no new block and release none (the coordinator's steady limits;
            # read here, not through a call, since this runs for every running request every step).
            limits = self._steady.get(request_id)
            if limits is not None and num_tokens <= limits[0] and num_computed < limits[1] \
                    and (companion is None or companion._covers(request_id, num_tokens)):
                return self._nothing_new
            computed = self._no_hit
        num_tokens += computed.num_tokens
        # Blocks that left the window are released before counting what the step needs.
        self.coordinator.remove_skipped_blocks(request_id, num_computed)
        if companion is not None and not companion._fits(request_id, num_tokens, computed.companion):
            return None
        admitted = request_id not in self.coordinator.steady
        new_ids = self.coordinator.allocate(request_id, num_computed + computed.num_tokens, num_tokens, computed.blocks)
        if new_ids is not None:
            if companion is not None:
                companion._follow(request, num_tokens, computed.companion)
            if admitted:
                self._count_admission(request, computed.num_tokens, computed.attention_tokens)
        return new_ids

    def _count_admission(self, request: KVRequest, hit_tokens: int, attention_tokens: int) -> None:
        """Prefix-cache statistics and the capture plan of a request's admission (counted once per
        admission that succeeds, not per lookup that had to wait)."""
        if not self.caching_possible:
            return
        self._requests += 1
        self._queries += len(request.token_ids)
        self._hits += hit_tokens
        self._state_lost += max(0, attention_tokens - hit_tokens)
        if self.checkpointing:
            stride = self.stride
            junction = attention_tokens // stride * stride
            self._plans[request.request_id] = CapturePlan(
                stride, len(request.token_ids), junction if junction > hit_tokens else 0,
                self.config.checkpoint_interval)

    # -- as a companion ------------------------------------------------------------------------

    def _covers(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's tables already cover `num_tokens` tokens in every group."""
        limits = self._steady.get(request_id)
        return limits is not None and num_tokens <= limits[0]

    def _fits(self, request_id: str, num_tokens: int, hit: ComputedBlocks | None) -> bool:
        """Whether `_follow` can cover `num_tokens` tokens after taking `hit`."""
        blocks = self._no_hit.blocks if hit is None else hit.blocks
        needed = self.coordinator.num_blocks_to_allocate(request_id, num_tokens, blocks)
        return all(n <= pool.num_free for n, pool in zip(needed, self.coordinator.pools))

    def _follow(self, request: KVRequest, num_tokens: int, hit: ComputedBlocks | None) -> None:
        """Cover `num_tokens` tokens of the request the manager followed allocated (`_fits` said they
        fit); on its admission take `hit`, whose rows the draft then holds (`admitted_rows`)."""
        request_id = request.request_id
        if request_id not in self.coordinator.steady:
            hit = hit or self._no_hit
            self._admitted_rows[request_id] = hit.num_tokens
            self._count_admission(request, hit.num_tokens, hit.attention_tokens)
            self.coordinator.allocate(request_id, hit.num_tokens, num_tokens, hit.blocks)
        elif not self._covers(request_id, num_tokens):
            self.coordinator.allocate(request_id, 0, num_tokens, self._no_hit.blocks)

    def admitted_rows(self, request_id: str) -> int | None:
        """As a companion: the rows of its hit a request was admitted with, once (None: taken already,
        or the request holds nothing here)."""
        return self._admitted_rows.pop(request_id, None)

    def reserve_companion(self, request: KVRequest, num_new_tokens: int) -> bool:
        """Cover `num_new_tokens` more tokens of the running `request` in the companion's groups (a
        step's drafts, which the draft writes before the target allocates their slots); False, nothing
        changed, if they do not fit."""
        companion, num_tokens = self.companion, request.num_computed_tokens + num_new_tokens
        if companion._covers(request.request_id, num_tokens):
            return True
        if not companion._fits(request.request_id, num_tokens, None):
            return False
        companion._follow(request, num_tokens, None)
        return True

    def num_external_tokens(self, request: KVRequest, computed: ComputedBlocks) -> int:
        """Prompt tokens past the device hit `computed` that a second tier holds (0 without one);
        a whole number of blocks in every group, leaving one token to compute. Not yet verified:
        `allocate_external_computed_blocks` reports what loaded."""
        if self.external is None:
            return 0
        return self.external.num_external_tokens(request, computed.num_tokens)

    def external_loads_ready(self, request: KVRequest, computed: ComputedBlocks, num_external_tokens: int) -> bool:
        """Start reading the `num_external_tokens` tokens past the hit `computed` off the scheduler's thread;
        whether they are read, so that `allocate_external_computed_blocks` would not wait for a tier."""
        return self.external.loads_ready(request, computed.num_tokens, num_external_tokens)

    def allocate_external_computed_blocks(self, request: KVRequest, num_new_tokens: int, computed: ComputedBlocks,
                                          num_external_tokens: int) -> int | None:
        """Admit `request` with the hit `computed`, up to `num_external_tokens` tokens from the second tier
        and room for `num_new_tokens` more after those that load, in every group, or None (nothing
        changed) when they may not fit.

        Returns the tokens loaded: the external ones up to the first block whose entry was missing or
        failed its check; the request computes `num_new_tokens` from there."""
        if num_new_tokens <= 0 or num_external_tokens <= 0:
            raise ValueError(f"allocate_external_computed_blocks needs new and external tokens, got "
                             f"{num_new_tokens} and {num_external_tokens}")
        companion, request_id = self.companion, request.request_id
        if companion is not None and not companion._fits(
                request_id, computed.num_tokens + num_external_tokens + num_new_tokens, computed.companion):
            return None  # (the most blocks it could need: loads that fail leave their tokens to compute)
        admitted = request_id not in self.coordinator.steady
        loaded = self.external.allocate(request, computed, num_external_tokens, num_new_tokens)
        if loaded is not None:
            if companion is not None:  # the draft computes what the tier loaded for the target
                companion._follow(request, computed.num_tokens + loaded + num_new_tokens, computed.companion)
            if admitted:
                self._count_admission(request, computed.num_tokens + loaded, computed.attention_tokens)
        return loaded

    def plan_captures(self, request: KVRequest, start: int, num_tokens: int) -> None:
        """Checkpoint the request's recurrent state where the capture plan says, inside the step
        that computes tokens [start, start + num_tokens) (no-op for models without state)."""
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        positions, is_decode = plan.positions(start, start + num_tokens)
        if not positions:
            return
        hashes = request.block_hashes.get(self.stride, request.token_ids)
        probe = self.coordinator.state_managers[0].checkpoints
        # Positions already checkpointed are skipped; one past the tokens known (async scheduling: an
        # input still in flight) has no hash yet, so it is captured, and a twin is dropped on commit.
        known = len(request.token_ids)
        positions = [p for p in positions if p > known or probe.lookup(hashes[p // self.stride - 1]) is None]
        if positions:
            # A decode step of several tokens scores drafts: a rejected one may drop its captures.
            self.coordinator.capture(request.request_id, positions, is_decode, verifying=num_tokens > 1)

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """C4: enter the full blocks among the first `num_computed_tokens` (KV written) in the cache."""
        if self.enable_caching and num_computed_tokens >= self.coordinator.next_cache_at.get(request.request_id, 0):
            external = self.external
            if external is not None:
                before = [m.num_cached.get(request.request_id, 0) for m in self.coordinator.managers]
                capturing = external.capturing(request.request_id)
            self.coordinator.cache_blocks(
                request.request_id, lambda bs: request.block_hashes.get(bs, request.token_ids), num_computed_tokens
            )
            if external is not None:
                external.order_saves(request, before, capturing)

    def trim_slots(self, request: KVRequest, num_tokens: int) -> None:
        """Speculative decoding: free the blocks past the first `num_tokens` tokens, which hold only
        rejected drafts' slots (never reported computed, never cached: C4)."""
        if num_tokens < request.num_computed_tokens:
            raise ValueError(f"request {request.request_id}: cannot trim to {num_tokens} tokens, below its "
                             f"{request.num_computed_tokens} computed ones")
        self.coordinator.trim(request.request_id, num_tokens, request.num_computed_tokens)
        companion = self.companion
        if companion is not None and request.request_id in companion.coordinator.steady:
            # The draft's rows past them are drafts too (its own rows never reach the target's last token).
            companion.coordinator.trim(request.request_id, num_tokens, num_tokens)

    def free(self, request_id: str) -> None:
        """Release every block and state slot the request holds (in a companion too). Idempotent."""
        if self.companion is not None:
            self.companion.free(request_id)
        self._admitted_rows.pop(request_id, None)
        self._plans.pop(request_id, None)
        if self.external is not None:
            self.external.forget(request_id)
        self.coordinator.free(request_id)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's whole block table, per group."""
        return self.coordinator.block_ids(request_id)

    def take_pending(self) -> PendingWork:
        """C2: the zero, poison, copy and capture orders since the last call (see kv/pending.py)."""
        self.coordinator.end_of_step_orders()
        return self._pending.take()

    def pending_is_empty(self) -> bool:
        return self._pending.is_empty()

    # -- capacity and admission ----------------------------------------------------------------

    def never_fits(self, num_tokens: int, max_chunk_tokens: int | None = None) -> str | None:
        """Why a request of `num_tokens` tokens could never fit even alone (with a companion, in the
        draft model's groups too), or None if it can."""
        for i, (group, pool) in enumerate(zip(self.config.groups, self.coordinator.pools)):
            need = group.spec.max_blocks_held(num_tokens, max_chunk_tokens)
            if need > pool.capacity:
                return (
                    f"a request of {num_tokens} tokens needs {need} blocks of KV cache group {i} "
                    f"({type(group.spec).__name__}) but the group has only {pool.capacity}; "
                    f"shorten the request or give the KV cache more memory"
                )
        if self.companion is not None:
            reason = self.companion.never_fits(num_tokens, max_chunk_tokens)
            return None if reason is None else f"{reason} (the draft model's)"
        return None

    def usage(self) -> list[float]:
        """Fraction of each group's blocks in use."""
        return [pool.usage for pool in self.coordinator.pools]

    def num_free_blocks(self) -> list[int]:
        return [pool.num_free for pool in self.coordinator.pools]

    def prefix_cache_stats(self) -> PrefixCacheStats:
        evictions = sum(pool.num_evictions for pool in self.coordinator.pools)
        checkpoints = [m.checkpoints for m in self.coordinator.state_managers if m.checkpoints is not None]
        return PrefixCacheStats(
            self._requests, self._queries, self._hits, evictions + sum(c.num_evictions for c in checkpoints),
            self._state_lost, sum(c.num_captures for c in checkpoints), sum(c.num_restores for c in checkpoints),
            0 if self.external is None else self.external.num_loaded_tokens)

    def offload_stats(self) -> OffloadStats | None:
        """The second tier's counters (None without one)."""
        return None if self.external is None else self.external.store.stats()

    def capacity_report(self) -> str:
        return self.config.capacity_report()

    def reset_prefix_cache(self) -> ResetResult:
        """Forget every cached prefix, in all groups (a companion's too) or (if any block is in use) in none."""
        managers = [self] if self.companion is None else [self, self.companion]
        for manager, whose in zip(managers, ("", " of the draft model")):
            for pool in manager.coordinator.pools:
                if pool.num_in_use:
                    return ResetResult(False, f"cannot reset the prefix cache while requests hold blocks: "
                                              f"{pool.num_in_use} in use in group {pool.group_id}{whose}")
        for manager in managers:
            for pool in manager.coordinator.pools:
                pool.reset_prefix_cache()
            for state_manager in manager.coordinator.state_managers:
                if state_manager.checkpoints is not None:
                    state_manager.checkpoints.reset()
        return ResetResult(True)

    # -- C3 ------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every pool's books balance against the request tables."""
        for manager, pool in zip(self.coordinator.managers, self.coordinator.pools):
            holders: Counter[int] = Counter()
            for request_id, blocks in manager.req_blocks.items():
                ids = [b.block_id for b in blocks if b is not pool.null_block]
                assert len(ids) == len(set(ids)), f"request {request_id} holds a block twice in group {pool.group_id}"
                holders.update(ids)
                assert manager.num_cached.get(request_id, 0) <= len(blocks), (
                    f"request {request_id} has more cached blocks than blocks in group {pool.group_id}")
            assert set(manager.num_cached) <= set(manager.req_blocks), "cached counts outlive their requests"
            pool.check_integrity(holders)
        holding = set().union(*(m.req_blocks for m in self.coordinator.managers))
        assert set(self.coordinator.steady) <= holding, "fast-path limits outlive their requests"
        assert set(self.coordinator.next_cache_at) <= holding, "cache points outlive their requests"
        assert set(self._plans) <= holding, "capture plans outlive their requests"
        assert set(self._admitted_rows) <= holding, "admission hits outlive their requests"
        if self.companion is not None:
            drafted = set().union(*(m.req_blocks for m in self.companion.coordinator.managers))
            assert drafted <= holding, f"the companion holds blocks of requests the target does not: {drafted - holding}"
        for manager in self.coordinator.state_managers:
            if manager.checkpoints is not None:
                manager.checkpoints.check_integrity(manager.capturing_slots(), set(manager.req_blocks), manager.pins())

    def assert_idle(self) -> None:
        """After every request finished: no request holds anything, every block is free."""
        self.check_integrity()
        for manager, pool in zip(self.coordinator.managers, self.coordinator.pools):
            assert not manager.req_blocks, f"group {pool.group_id}: requests still hold blocks: {list(manager.req_blocks)}"
            assert pool.num_free == pool.capacity, f"group {pool.group_id}: {pool.num_in_use} blocks not freed"
        for manager in self.coordinator.state_managers:
            assert manager.is_idle(), f"group {manager.pool.group_id}: checkpoints still owned, pinned or capturing"
        assert not self._plans, f"capture plans remain: {list(self._plans)}"
        if self.external is not None:
            self.external.store.flush()
            assert self.external.store.is_idle(), "a save order was claimed but never submitted or released"
            assert not self.external.waiting_requests(), \
                f"prefetches still waited for: {self.external.waiting_requests()}"
