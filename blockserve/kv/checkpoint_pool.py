"""One state group's checkpoints: saved recurrent states that prefix-cache hits restore.

A checkpoint is a state slot outside the group's running slots holding the state after the
first `position` tokens of some sequence (a multiple of the checkpoint stride). It is keyed by
the hash of those tokens in the request's hash chain, salt included, so tenants stay apart
(C6) as with attention blocks.

    slot ids [first, first + count)   this pool's; the running slots below belong to the BlockPool
    free          holds nothing
    capturing     this step's forward writes it; cached only after that forward ran (C4)
    cached        in `cached` under its key; `ref_cnt` > 0 while a restore from it is pending
                  this step; evictable at ref_cnt 0

A restore copies a checkpoint into a running slot (the checkpoint stays cached) and refreshes
only that checkpoint's recency. Eviction takes the cached, unpinned checkpoint of lowest score

    score = (1 - w) * recency + w * savings        each in [0, 1] over the candidates

where recency ranks last use and savings are the tokens a checkpoint saves over the nearest
shallower checkpoint of its chain when it was taken (a cheap stand-in for compute saved per
byte); w = 0 is plain LRU. A checkpoint whose attention block at its position left the cache
can never hit again and is released at once (`forget_attention_block`).
"""

from __future__ import annotations

from collections import Counter

from blockserve.kv.hashing import BlockHash
from blockserve.kv.pending import PendingWork


class Checkpoint:
    __slots__ = ("slot", "key", "position", "saves", "ref_cnt", "last_used", "cached", "probes", "owner")

    def __init__(self, slot: int):
        self.slot = slot
        self.owner: str | None = None  # the request capturing into it, or keeping it as its decode spare
        self.key: BlockHash | None = None
        self.position = 0
        self.saves = 0
        self.ref_cnt = 0
        self.last_used = 0
        self.cached = False
        self.probes: tuple[tuple[int, BlockHash], ...] = ()  # (attention group, block hash at position)

    def __repr__(self) -> str:
        return f"Checkpoint(slot={self.slot}, position={self.position}, ref={self.ref_cnt}, cached={self.cached})"


class CheckpointPool:
    def __init__(self, first_slot: int, count: int, group_id: int, pending: PendingWork,
                 poison_freed_slots: bool = False, savings_weight: float = 0.0):
        self.group_id = group_id
        self.first_slot = first_slot
        self.capacity = count
        self.checkpoints = [Checkpoint(first_slot + i) for i in range(count)]
        self._free: list[Checkpoint] = self.checkpoints[::-1]  # popped from the end: low slots first
        self.cached: dict[BlockHash, Checkpoint] = {}
        self._by_probe: dict[tuple[int, BlockHash], set[Checkpoint]] = {}
        self._pending = pending
        self._poison = poison_freed_slots
        self._weight = savings_weight
        self._clock = 0
        self.num_captures = self.num_restores = self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, key: BlockHash) -> Checkpoint | None:
        return self.cached.get(key)

    # -- capture ---------------------------------------------------------------------------------

    def take_for_capture(self, owner: str, reuse: Checkpoint | None = None,
                         keep: Checkpoint | None = None) -> Checkpoint | None:
        """A slot this step's forward may write for request `owner`: `reuse` if `owner` still
        owns it and it is not pinned, else a free slot, else the eviction policy's victim other
        than `keep` (a decode spare among them loses its owner); None if every other slot is
        pinned or capturing (best effort: no checkpoint this time)."""
        if reuse is not None and reuse.owner == owner and reuse.ref_cnt == 0:
            self._uncache(reuse)
            return reuse
        if self._free:
            ckpt = self._free.pop()
        else:
            ckpt = self._victim(keep)
            if ckpt is None:
                return None
            self._uncache(ckpt)
            self.num_evictions += 1
            self._record_poison(ckpt)  # applied before this step's forward writes it again
        ckpt.owner = owner
        return ckpt

    def commit(self, ckpt: Checkpoint, key: BlockHash, position: int, saves: int,
               probes: tuple[tuple[int, BlockHash], ...], keep_owner: bool) -> None:
        """The forward that wrote `ckpt` has run: cache it under `key`, still owned by its
        request if `keep_owner` (a decode spare). A twin already cached under `key` wins, and
        `ckpt` is released."""
        if key in self.cached:
            self.release(ckpt)
            return
        if not keep_owner:
            ckpt.owner = None
        ckpt.key, ckpt.position, ckpt.saves, ckpt.probes = key, position, saves, probes
        ckpt.cached = True
        self._clock += 1
        ckpt.last_used = self._clock
        self.cached[key] = ckpt
        for probe in probes:
            self._by_probe.setdefault(probe, set()).add(ckpt)
        self.num_captures += 1

    def release(self, ckpt: Checkpoint) -> None:
        """Give a capturing or cached, unpinned checkpoint's slot back; its content is garbage."""
        assert ckpt.ref_cnt == 0, f"{ckpt} is pinned by a pending restore"
        self._uncache(ckpt)
        ckpt.owner = None
        self._record_poison(ckpt)
        self._free.append(ckpt)

    # -- restore ---------------------------------------------------------------------------------

    def pin(self, ckpt: Checkpoint) -> None:
        """A restore from `ckpt` is pending this step: it must not be evicted or overwritten."""
        ckpt.ref_cnt += 1
        self._clock += 1
        ckpt.last_used = self._clock
        self.num_restores += 1

    def unpin(self, ckpt: Checkpoint) -> None:
        ckpt.ref_cnt -= 1

    # -- eviction --------------------------------------------------------------------------------

    def _victim(self, keep: Checkpoint | None = None) -> Checkpoint | None:
        candidates = [c for c in self.cached.values() if c.ref_cnt == 0 and c is not keep]
        if not candidates:
            return None
        if not self._weight:
            return min(candidates, key=lambda c: c.last_used)
        oldest = min(c.last_used for c in candidates)
        age_span = max(c.last_used for c in candidates) - oldest or 1
        most_saved = max(c.saves for c in candidates) or 1
        w = self._weight
        return min(candidates,
                   key=lambda c: (1 - w) * (c.last_used - oldest) / age_span + w * c.saves / most_saved)

    def forget_attention_block(self, attention_group: int, block_hash: BlockHash) -> None:
        """An attention group stopped caching `block_hash`: checkpoints at its position can never hit."""
        for ckpt in list(self._by_probe.get((attention_group, block_hash), ())):
            if ckpt.ref_cnt == 0:
                self.release(ckpt)
                self.num_evictions += 1

    def reset(self) -> None:
        """Release every cached checkpoint; the caller made sure none is pinned or capturing."""
        for ckpt in list(self.cached.values()):
            self.release(ckpt)

    def _uncache(self, ckpt: Checkpoint) -> None:
        if not ckpt.cached:
            return
        del self.cached[ckpt.key]
        for probe in ckpt.probes:
            twins = self._by_probe[probe]
            twins.discard(ckpt)
            if not twins:
                del self._by_probe[probe]
        ckpt.cached, ckpt.key, ckpt.probes = False, None, ()

    def _record_poison(self, ckpt: Checkpoint) -> None:
        if self._poison:
            self._pending.blocks_to_poison.setdefault(self.group_id, []).append(ckpt.slot)

    # -- C3 --------------------------------------------------------------------------------------

    def check_integrity(self, capturing: set[int], live: set[str], pins: Counter[int]) -> None:
        """Raise AssertionError unless every slot is free, capturing (`capturing`: the slots
        this step's forward writes) or cached, owners are live requests (`live`), and the maps
        agree. `pins`: restores pending per slot."""
        gid = self.group_id
        free = {c.slot for c in self._free}
        assert len(free) == len(self._free), f"group {gid}: a checkpoint slot is free twice"
        for ckpt in self.checkpoints:
            assert ckpt.owner is None or ckpt.owner in live, f"group {gid}: {ckpt} owned by finished {ckpt.owner}"
            assert (ckpt.slot in capturing) <= (ckpt.owner is not None), f"group {gid}: capturing {ckpt} has no owner"
            assert ckpt.ref_cnt == pins.get(ckpt.slot, 0), f"group {gid}: {ckpt} has {pins.get(ckpt.slot, 0)} pins"
            assert not ckpt.ref_cnt or ckpt.cached, f"group {gid}: pinned {ckpt} is not cached"
            if ckpt.slot in free:
                assert not ckpt.cached and ckpt.owner is None, f"group {gid}: free {ckpt} is in use"
            else:
                assert ckpt.cached != (ckpt.slot in capturing), f"group {gid}: {ckpt} must be cached or capturing"
            if ckpt.cached:
                assert self.cached.get(ckpt.key) is ckpt, f"group {gid}: {ckpt} is not mapped under its key"
                for probe in ckpt.probes:
                    assert ckpt in self._by_probe.get(probe, ()), f"group {gid}: {ckpt} probe unmapped"
        assert all(c.cached for c in self.cached.values()), f"group {gid}: an uncached checkpoint is mapped"
        assert all(twins for twins in self._by_probe.values()), f"group {gid}: an empty probe entry"
