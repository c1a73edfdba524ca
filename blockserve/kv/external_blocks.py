"""Blocks whose KV comes from outside the device pool: the second tier (kv/tiers/) behind the
prefix cache, seen by the KV manager.

On admission, after the device pool's hit:

    device hit       [b3][b7]                        touched, as always
    external         [  ][  ][l1][l2][l3]            num_external_tokens: what the tiers hold next
    new              [  ][  ][  ][  ][  ][n1]        computed by the step
    state group      [s5]  the running slot, loaded with the tier's checkpoint at the external end

`allocate` takes the hit, reads and verifies the external blocks, allocates a device block for each
one that passed (no zero order: its load order writes every slot first, C1) and queues its load
order (C2); the rest of the prompt, from the first block that failed, gets ordinary new blocks and
is computed again. With recurrent-state groups an external run must end where the tiers hold a
state checkpoint (a multiple of the checkpoint stride) in every state group: the running slot is
loaded from it instead of being zeroed or restored from a device checkpoint; if that checkpoint or
an attention block before it fails its check, nothing is loaded and the device hit stands.
Loaded blocks enter the prefix cache like computed ones, after the step (C4). After
`cache_blocks`, each block and state checkpoint newly cached gets a save order unless the tiers
hold it already.

Sliding-window groups have no external blocks (the engine refuses tiers for such models).
"""

from __future__ import annotations

from collections.abc import Sequence

from blockserve.kv.config import KVCacheConfig
from blockserve.kv.coordinator import KVCacheCoordinator
from blockserve.kv.pending import PendingWork
from blockserve.kv.specs import FullAttentionSpec, LinearStateSpec, MLASpec, SlidingWindowSpec
from blockserve.kv.tiers.store import TieredKVStore


def unsupported_groups(config: KVCacheConfig) -> list[str]:
    """The groups a second tier cannot serve, described (empty: every group can be)."""
    return [f"group {i} ({type(g.spec).__name__})" for i, g in enumerate(config.groups)
            if isinstance(g.spec, SlidingWindowSpec)
            or not isinstance(g.spec, (FullAttentionSpec, MLASpec, LinearStateSpec))]


class ExternalBlocks:
    def __init__(self, config: KVCacheConfig, coordinator: KVCacheCoordinator, pending: PendingWork,
                 store: TieredKVStore):
        if bad := unsupported_groups(config):
            raise ValueError("a second prefix-cache tier serves full-attention, MLA and recurrent-state groups; "
                             f"this model also has {', '.join(bad)}: run it without --kv-offload-dir / "
                             "--kv-offload-memory")
        self.store = store
        self.coordinator = coordinator
        self.pending = pending
        self.attention = [i for i, g in enumerate(config.groups) if not g.is_state]
        self.states = [i for i, g in enumerate(config.groups) if g.is_state]
        # An external run ends on a block boundary in every group (a stride multiple with state groups).
        self.unit = config.checkpoint_stride
        self.block_sizes = [coordinator.managers[i].block_size for i in range(len(config.groups))]
        self.num_loaded_tokens = 0  # cumulative: prompt tokens whose KV a tier supplied

    def _keys(self, request, group_id: int, start: int, end: int) -> list[bytes]:
        bs = self.block_sizes[group_id]
        hashes = request.block_hashes.get(bs, request.token_ids)
        return [self.store.key(group_id, h) for h in hashes[start // bs : end // bs]]

    def _state_keys(self, request, position: int) -> list[bytes]:
        """The keys of every state group's checkpoint after the first `position` tokens."""
        return [self._keys(request, g, position - self.unit, position)[0] for g in self.states]

    def num_external_tokens(self, request, num_computed: int) -> int:
        """Tokens past the device hit's `num_computed` that the tiers hold, leaving one to compute."""
        bound = (len(request.token_ids) - 1) // self.unit * self.unit
        if num_computed % self.unit or bound <= num_computed:
            return 0
        end = bound
        for group_id in self.attention:
            held = self.store.num_held(self._keys(request, group_id, num_computed, end))
            end = min(end, num_computed + held * self.block_sizes[group_id])
        end = end // self.unit * self.unit
        if self.states:  # the deepest position there with a checkpoint in every state group
            while end > num_computed and self.store.num_held(self._state_keys(request, end)) < len(self.states):
                end -= self.unit
        return max(0, end - num_computed)

    def _load(self, request, start: int, end: int) -> tuple[int, dict[int, list[bytearray]]]:
        """(the end of the run that loaded intact, each group's payloads up to it)."""
        payloads = {}
        for group_id in self.attention:
            payloads[group_id] = self.store.load(self._keys(request, group_id, start, end))
            end = min(end, start + len(payloads[group_id]) * self.block_sizes[group_id])
        end = start + (end - start) // self.unit * self.unit
        if self.states and end > start:
            states = self.store.load(self._state_keys(request, end))
            if len(states) < len(self.states):
                return start, {}  # no state to resume from: the device hit stands
            payloads.update((g, [p]) for g, p in zip(self.states, states))
        return end, payloads

    def allocate(self, request, computed, num_external: int, num_tokens: int) -> int | None:
        """Blocks for `num_tokens` tokens (the hit `computed`, `num_external` external ones, then new
        ones) in every group, or None (nothing read, nothing changed) when they do not fit. Returns the
        tokens loaded: the external ones up to the first block that failed its read or check."""
        rid, start = request.request_id, computed.num_tokens
        needed = self.coordinator.num_blocks_to_allocate(rid, num_tokens, computed.blocks)
        if any(n > pool.num_free for n, pool in zip(needed, self.coordinator.pools)):
            return None
        end, payloads = self._load(request, start, start + num_external)
        if end == start:
            if self.coordinator.allocate(rid, start, num_tokens, computed.blocks) is None:
                raise AssertionError(f"request {rid}: blocks checked free ran out during allocation")
            return 0
        # A loaded state replaces the device checkpoint the hit would have restored.
        hit = [() if g in self.states else blocks for g, blocks in enumerate(computed.blocks)]
        loaded = self.coordinator.allocate_loaded(rid, hit, end)
        for group_id, blocks in enumerate(loaded):
            if blocks:
                self.pending.blocks_to_load.setdefault(group_id, []).extend(
                    (b.block_id, p) for b, p in zip(blocks, payloads[group_id]))
        no_hit = tuple(() for _ in self.block_sizes)
        if self.coordinator.allocate(rid, end, num_tokens, no_hit) is None:
            raise AssertionError(f"request {rid}: blocks checked free ran out during allocation")
        self.num_loaded_tokens += end - start
        return end - start

    def capturing(self, request_id: str) -> list[tuple[int, object]]:
        """(state group, checkpoint) of the request's captures not yet committed."""
        return [(g, ckpt) for g in self.states for ckpt in self.coordinator.managers[g].captures_of(request_id)]

    def order_saves(self, request, cached_before: Sequence[int], capturing_before) -> None:
        """Save orders for what `cache_blocks` just cached: attention blocks (each group's cached count
        before it was `cached_before[group]`) and the checkpoints of `capturing_before` now cached, that
        the tiers do not hold yet."""
        rid = request.request_id
        for group_id in self.attention:
            manager, before = self.coordinator.managers[group_id], cached_before[group_id]
            after = manager.num_cached.get(rid, 0)
            if after <= before:
                continue
            hashes = request.block_hashes.get(self.block_sizes[group_id], request.token_ids)
            blocks = manager.req_blocks[rid]
            for i in range(before, after):
                self._order_save(group_id, blocks[i].block_id, hashes[i])
        still = {id(ckpt) for _, ckpt in self.capturing(rid)}
        for group_id, ckpt in capturing_before:
            if id(ckpt) not in still and ckpt.cached:
                self._order_save(group_id, ckpt.slot, ckpt.key)

    def _order_save(self, group_id: int, slot: int, block_hash: bytes) -> None:
        key = self.store.key(group_id, block_hash)
        if self.store.claim(key):
            self.pending.blocks_to_save.setdefault(group_id, []).append((slot, key))
