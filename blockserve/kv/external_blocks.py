"""Blocks whose KV comes from outside the device pool: the second tier (kv/tiers/) behind the
prefix cache, seen by the KV manager.

On admission, after the device pool's hit:

    device hit       [b3][b7]                        touched, as always
    external         [  ][  ][l1][l2][l3]            num_external_tokens: what the tiers hold next
    new              [  ][  ][  ][  ][  ][n1]        computed by the step
    sliding window   [--][--][--][--][l2][l3][n1]    only the blocks the window reaches back to
    state group      [s5]  the running slot, loaded with the tier's checkpoint at the external end

`allocate` takes the hit, reads and verifies the external blocks, allocates a device block for each
one that passed (no zero order: its load order writes every slot first, C1) and queues its load
order (C2); the rest of the prompt, from the first block that failed, gets ordinary new blocks and
is computed again.

A sliding-window group needs, to go on computing from a position p, only the blocks holding the
`sliding_window - 1` tokens before p: the run ends at the deepest p where the tiers (or the device
hit) hold those in every window group, only they are read and loaded, and the table entries before
them are the null block, as for a device hit. Every block of such a group is still saved, since a
later prompt may share any prefix of this one and then needs the window before its own end.

With recurrent-state groups an external run must end where the tiers hold a state checkpoint (a
multiple of the checkpoint stride) in every state group: the running slot is loaded from it
instead of being zeroed or restored from a device checkpoint; if that checkpoint or an attention
block before it fails its check, nothing is loaded and the device hit stands. Loaded blocks enter
the prefix cache like computed ones, after the step (C4). After `cache_blocks`, each block and
state checkpoint newly cached gets a save order unless the tiers hold it already.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockserve.kv.config import KVCacheConfig
from blockserve.kv.coordinator import KVCacheCoordinator
from blockserve.kv.pending import PendingWork
from blockserve.kv.specs import FullAttentionSpec, LinearStateSpec, MLASpec, SlidingWindowSpec, cdiv
from blockserve.kv.tiers.store import TieredKVStore


def unsupported_groups(config: KVCacheConfig) -> list[str]:
    """The groups a second tier cannot serve, described (empty: every group can be)."""
    return [f"group {i} ({type(g.spec).__name__})" for i, g in enumerate(config.groups)
            if not isinstance(g.spec, (FullAttentionSpec, MLASpec, LinearStateSpec))]


class ExternalBlocks:
    def __init__(self, config: KVCacheConfig, coordinator: KVCacheCoordinator, pending: PendingWork,
                 store: TieredKVStore):
        if bad := unsupported_groups(config):
            raise ValueError("a second prefix-cache tier serves attention, MLA and recurrent-state groups; "
                             f"this model also has {', '.join(bad)}: run it without --kv-offload-dir / "
                             "--kv-offload-memory")
        self.store = store
        self.coordinator = coordinator
        self.pending = pending
        self.attention = [i for i, g in enumerate(config.groups) if not g.is_state]
        # Sliding-window groups: the blocks before a position that its token's window reaches.
        self.windows = {i: max(1, cdiv(g.spec.sliding_window - 1, g.spec.block_size))
                        for i, g in enumerate(config.groups) if isinstance(g.spec, SlidingWindowSpec)}
        self.full = [i for i in self.attention if i not in self.windows]
        self.states = [i for i, g in enumerate(config.groups) if g.is_state]
        # An external run ends on a block boundary in every group (a stride multiple with state groups).
        self.unit = config.checkpoint_stride
        self.block_sizes = [coordinator.managers[i].block_size for i in range(len(config.groups))]
        self.num_loaded_tokens = 0  # cumulative: prompt tokens whose KV a tier supplied
        self._asked: dict[str, set[bytes]] = {}  # per waiting request, the keys its prefetches asked for
        self.num_load_waits = 0  # cumulative: admissions put off a step while their blocks were read

    def _keys(self, request, group_id: int, start: int, end: int) -> list[bytes]:
        bs = self.block_sizes[group_id]
        hashes = request.block_hashes.get(bs, request.token_ids)
        return [self.store.key(group_id, h) for h in hashes[start // bs : end // bs]]

    def _state_keys(self, request, position: int) -> list[bytes]:
        """The keys of every state group's checkpoint after the first `position` tokens."""
        return [self._keys(request, g, position - self.unit, position)[0] for g in self.states]

    def _window_start(self, group_id: int, start: int, end: int) -> int:
        """The first token of the window group's blocks a run from `start` to `end` loads."""
        bs = self.block_sizes[group_id]
        return max(start, end - self.windows[group_id] * bs)

    def num_external_tokens(self, request, num_computed: int) -> int:
        """Tokens past the device hit's `num_computed` that the tiers hold, leaving one to compute."""
        bound = (len(request.token_ids) - 1) // self.unit * self.unit
        if num_computed % self.unit or bound <= num_computed:
            return 0
        end = bound
        for group_id in self.full:
            held = self.store.num_held(self._keys(request, group_id, num_computed, end))
            end = min(end, num_computed + held * self.block_sizes[group_id])
        end = end // self.unit * self.unit
        # Per window group, the blocks from `num_computed` on that the tiers hold (not a prefix: any run may do).
        held = {g: [self.store.holds(k) for k in self._keys(request, g, num_computed, end)] for g in self.windows}

        def resumable(position: int) -> bool:
            for g, flags in held.items():
                bs = self.block_sizes[g]
                first = (self._window_start(g, num_computed, position) - num_computed) // bs
                if not all(flags[first : (position - num_computed) // bs]):
                    return False
            return not self.states or self.store.num_held(self._state_keys(request, position)) == len(self.states)

        while end > num_computed and not resumable(end):  # the deepest position every group can resume at
            end -= self.unit
        return max(0, end - num_computed)

    def _load(self, request, start: int, end: int) -> tuple[int, dict[int, list[bytearray]]]:
        """(the end of the run that loaded intact, each group's payloads up to it: a window group's
        from its `_window_start`)."""
        payloads = {}
        for group_id in self.full:
            payloads[group_id] = self.store.load(self._keys(request, group_id, start, end))
            end = min(end, start + len(payloads[group_id]) * self.block_sizes[group_id])
        end = start + (end - start) // self.unit * self.unit
        read: dict[bytes, bytearray | None] = {}  # window blocks read so far (each key read once)

        def window_payloads(position: int) -> dict[int, list[bytearray]] | None:
            found = {}
            for g in self.windows:
                keys = self._keys(request, g, self._window_start(g, start, position), position)
                for key in keys:
                    if key not in read:
                        read[key] = next(iter(self.store.load([key])), None)
                    if read[key] is None:
                        return None
                found[g] = [read[key] for key in keys]
            return found

        while end > start and (windows := window_payloads(end)) is None:
            end -= self.unit
        if end == start:
            return start, {}
        payloads.update(windows)
        for group_id in self.full:
            del payloads[group_id][(end - start) // self.block_sizes[group_id]:]
        if self.states:
            states = self.store.load(self._state_keys(request, end))
            if len(states) < len(self.states):
                return start, {}  # no state to resume from: the device hit stands
            payloads.update((g, [p]) for g, p in zip(self.states, states))
        return end, payloads

    def _run_keys(self, request, start: int, end: int) -> list[bytes]:
        """The keys `_load` reads first for a run from `start` to `end`."""
        keys = [k for g in self.full for k in self._keys(request, g, start, end)]
        for g in self.windows:
            keys += self._keys(request, g, self._window_start(g, start, end), end)
        if self.states:
            keys += self._state_keys(request, end)
        return keys

    def loads_ready(self, request, start: int, num_external: int) -> bool:
        """Start reading what admitting `request` now would load, on the loader thread; whether it is all
        read (then `allocate` reads no tier). Each key is asked for once per admission, so a read the
        store dropped for room is done again by `allocate`, never waited for twice."""
        keys = self._run_keys(request, start, start + num_external)
        asked = self._asked.setdefault(request.request_id, set())
        self.store.prefetch([k for k in keys if k not in asked])
        asked.update(keys)
        if self.store.reading(keys):
            self.num_load_waits += 1
            return False
        return True

    def forget(self, request_id: str) -> None:
        """The request was admitted or left: its prefetches are no longer waited for."""
        self._asked.pop(request_id, None)

    def waiting_requests(self) -> list[str]:
        """The requests whose prefetches are still waited for (none once every request was admitted or left)."""
        return list(self._asked)

    def _most_blocks(self, request_id: str, computed, num_external: int, num_new: int) -> list[int]:
        """Per group, the most free blocks `allocate` may take, however much of the run loads: a full group's
        need grows with the run, a window group's is its window (hit, loaded or revived) and the new tokens'."""
        start = computed.num_tokens
        most = self.coordinator.num_blocks_to_allocate(request_id, start + num_external + num_new, computed.blocks)
        for g, window in self.windows.items():
            most[g] = min(most[g], window + cdiv(num_new, self.block_sizes[g]))
        return most

    def allocate(self, request, computed, num_external: int, num_new: int) -> int | None:
        """Blocks for the hit `computed`, up to `num_external` external tokens and `num_new` new ones after
        those that load, in every group, or None (nothing read, nothing changed) when they may not fit.
        Returns the tokens loaded: the external ones up to the first block that failed its read or check."""
        rid, start = request.request_id, computed.num_tokens
        needed = self._most_blocks(rid, computed, num_external, num_new)
        if any(n > pool.num_free for n, pool in zip(needed, self.coordinator.pools)):
            return None
        self.forget(rid)
        end, payloads = self._load(request, start, start + num_external)
        if end == start:
            if self.coordinator.allocate(rid, start, start + num_new, computed.blocks) is None:
                raise AssertionError(f"request {rid}: blocks checked free ran out during allocation")
            return 0
        # A loaded state replaces the device checkpoint the hit would have restored; a window group keeps
        # only the hit's blocks its window at `end` reaches.
        hit, firsts = [], {}
        for g, blocks in enumerate(computed.blocks):
            if g in self.states:
                blocks = ()
            elif g in self.windows:
                bs = self.block_sizes[g]
                firsts[g] = self._window_start(g, start, end) // bs
                null, reach = self.coordinator.pools[g].null_block, end // bs - self.windows[g]
                blocks = tuple(null if i < reach else b for i, b in enumerate(blocks))
            hit.append(blocks)
        loaded = self.coordinator.allocate_loaded(rid, hit, end, firsts)
        for group_id, blocks in enumerate(loaded):
            if blocks:
                self.pending.blocks_to_load.setdefault(group_id, []).extend(
                    (b.block_id, p) for b, p in zip(blocks, payloads[group_id], strict=True))
        no_hit = tuple(() for _ in self.block_sizes)
        if self.coordinator.allocate(rid, end, end + num_new, no_hit) is None:
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
