"""A recurrent-state group: one running slot per request, and checkpoints that hits restore.

    table        [s4]            the request's running slot (from the group's BlockPool)
    hit          the deepest cached checkpoint at a stride multiple <= the bound; allocating
                 the slot then records a copy order (checkpoint -> slot) instead of a zero order
    captures     positions chosen by `checkpoint_policy.CapturePlan`; each gets a checkpoint
                 slot now, is written by this step's forward, and is cached after it (C4)
    decode spare the request's latest decode-time capture: overwritten in place at its next
                 stride boundary, so a long reply holds one checkpoint, not one per stride. A step
                 verifying drafts captures each boundary among its tokens into a slot of its own
                 (the spare stays cached: a rejected draft may precede them); its result drops the
                 captures past the accepted tokens and commits the rest, the deepest becoming the
                 spare and the old spare released. Only when no other slot can be had does such a
                 step capture into the spare in place (rejected, the spare is then lost)

The slot ids of checkpoints follow the running slots in the group's tensors.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from blockserve.kv.block_pool import Block, BlockPool
from blockserve.kv.checkpoint_pool import Checkpoint, CheckpointPool
from blockserve.kv.group_managers import FullAttentionManager
from blockserve.kv.hashing import BlockHash
from blockserve.kv.pending import PendingWork
from blockserve.kv.specs import LinearStateSpec


class LinearStateManager(FullAttentionManager):
    spec: LinearStateSpec

    def __init__(self, spec: LinearStateSpec, pool: BlockPool, checkpoints: CheckpointPool | None, stride: int,
                 pending: PendingWork):
        super().__init__(spec, pool)
        self.checkpoints = checkpoints
        self._pending = pending  # where copy and capture orders go (C2)
        self.block_size = stride  # the hash chain the checkpoint keys come from
        self._restores: dict[str, Checkpoint] = {}  # admitted this step, slot not yet allocated
        self._pinned: list[Checkpoint] = []  # restores of this step, unpinned when its orders are taken
        # request -> (slot, position, a decode capture: committed, it becomes the decode spare)
        self._capturing: dict[str, list[tuple[Checkpoint, int, bool]]] = {}
        self._spare: dict[str, Checkpoint] = {}  # request -> its decode spare

    def table_len(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    # -- hits and restores -----------------------------------------------------------------------

    def find_longest_hit(self, hashes: list[BlockHash], max_tokens: int) -> list[Checkpoint]:
        """[the deepest cached checkpoint at or below `max_tokens`], or []."""
        if self.checkpoints is None:
            return []
        for i in range(min(max_tokens // self.block_size, len(hashes)) - 1, -1, -1):
            ckpt = self.checkpoints.lookup(hashes[i])
            if ckpt is not None:
                return [ckpt]
        return []

    def hit_tokens(self, hit: list) -> int:
        return hit[0].position if hit else 0

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, computed: Sequence) -> int:
        held = len(self.req_blocks.get(request_id, ()))
        return max(0, self.table_len(num_tokens) - held)  # a restore still needs its running slot

    def add_computed_blocks(self, request_id: str, computed: Sequence) -> None:
        if computed:
            ckpt = computed[0]
            self.checkpoints.pin(ckpt)
            self._pinned.append(ckpt)
            self._restores[request_id] = ckpt

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[Block]:
        blocks = self.req_blocks.setdefault(request_id, [])
        restore = self._restores.pop(request_id, None)
        new = self.pool.get_new_blocks(max(0, self.table_len(num_tokens) - len(blocks)), zero=restore is None)
        if restore is not None:
            self._pending.state_copies.setdefault(self.pool.group_id, []).append(
                (restore.slot, new[0].block_id))
        blocks.extend(new)
        return new

    def end_of_step_orders(self) -> None:
        """The step's copy orders are taken: its restores' checkpoints may be evicted again."""
        for ckpt in self._pinned:
            self.checkpoints.unpin(ckpt)
        self._pinned.clear()

    # -- captures --------------------------------------------------------------------------------

    def capture(self, request_id: str, positions: list[int], is_decode: bool,
                verifying: bool = False) -> list[tuple[int, int]]:
        """Checkpoint slots for `positions` (best effort: those that get one); records the
        capture orders and returns them as (position, slot). A decode capture reuses the
        request's decode spare; one of a step `verifying` drafts takes another slot while
        there is one, and the spare stays cached until `commit_captures`."""
        pool = self.checkpoints
        taken = []
        capturing = {p for _, p, _ in self._capturing.get(request_id, ())}
        for position in positions:
            if position in capturing:
                continue  # an earlier step's forward writes it already
            spare = self._spare.get(request_id) if is_decode else None
            if verifying and is_decode:
                ckpt = pool.take_for_capture(request_id, keep=spare)
                if ckpt is None and spare is not None and spare.cached:
                    ckpt = pool.take_for_capture(request_id, spare)  # no other slot: the spare, in place
            else:
                ckpt = pool.take_for_capture(request_id, spare if spare is not None and spare.cached else None)
                if ckpt is None:
                    continue  # the old spare, if any, stays the spare
                if is_decode:
                    if spare is not None and spare is not ckpt and spare.owner == request_id and spare.cached:
                        spare.owner = None  # pinned by a restore: it stays cached, owned by nobody
                    self._spare[request_id] = ckpt
            if ckpt is None:
                continue
            self._capturing.setdefault(request_id, []).append((ckpt, position, is_decode))
            taken.append((position, ckpt.slot))
        if taken:
            self._pending.state_captures.setdefault(self.pool.group_id, {})[request_id] = taken
        return taken

    def next_cache_point(self, request_id: str) -> float:
        captures = self._capturing.get(request_id)
        return min(p for _, p, _ in captures) if captures else math.inf

    def commit_captures(self, request_id: str, hashes_for, num_tokens: int, probes_at) -> None:
        """Cache the captures at or below `num_tokens` (their forward ran); a decode capture becomes
        the request's decode spare and releases the one before it. `hashes_for(size)` is the
        request's hash chain; `probes_at(position)` names the attention blocks ending there."""
        captures = self._capturing.get(request_id)
        if not captures:
            return
        pool, stride = self.checkpoints, self.block_size
        hashes = hashes_for(stride)
        remaining = []
        for ckpt, position, is_decode in captures:
            if position > num_tokens:
                remaining.append((ckpt, position, is_decode))
                continue
            if is_decode:
                self._retire_spare(request_id, ckpt)
            index = position // stride - 1
            parent = 0  # the nearest shallower checkpoint of the chain, or the empty prefix
            for i in range(index - 1, -1, -1):
                if (shallower := pool.lookup(hashes[i])) is not None:
                    parent = shallower.position
                    break
            pool.commit(ckpt, hashes[index], position, position - parent, probes_at(position), is_decode)
            if is_decode:
                if ckpt.cached:
                    self._spare[request_id] = ckpt
                elif self._spare.get(request_id) is ckpt:
                    del self._spare[request_id]  # a twin won: the released slot is no spare
        if remaining:
            self._capturing[request_id] = remaining
        else:
            del self._capturing[request_id]

    def _retire_spare(self, request_id: str, successor: Checkpoint) -> None:
        """`successor`, a decode capture, is about to be committed: the request's spare before it is
        released (one checkpoint per reply), or left cached to nobody while a restore pins it."""
        spare = self._spare.get(request_id)
        if spare is None or spare is successor:
            return
        del self._spare[request_id]
        if spare.owner != request_id or not spare.cached:
            return  # another request's capture took it, or it is capturing in place for a later position
        if spare.ref_cnt:
            spare.owner = None
        else:
            self.checkpoints.release(spare)

    def drop_captures(self, request_id: str, num_tokens: int) -> None:
        """Speculative decoding: release the captures past the first `num_tokens` tokens (they hold
        state after rejected drafts, so they are never cached: C4); a dropped decode spare is no spare."""
        captures = self._capturing.get(request_id)
        if not captures:
            return
        kept = []
        for ckpt, position, is_decode in captures:
            if position <= num_tokens:
                kept.append((ckpt, position, is_decode))
                continue
            if self._spare.get(request_id) is ckpt:
                del self._spare[request_id]
            self.checkpoints.release(ckpt)
        if kept:
            self._capturing[request_id] = kept
        else:
            del self._capturing[request_id]

    def cache_blocks(self, request_id: str, hashes: list[BlockHash], num_tokens: int) -> None:
        pass  # see commit_captures: checkpoints need the attention groups' hashes too

    def steady_limits(self, request_id: str, num_computed_tokens: int) -> tuple[float, float]:
        return (math.inf if request_id in self.req_blocks else 0), math.inf

    def free(self, request_id: str) -> None:
        """Release the running slot and any capture whose forward did not complete; the decode
        spare stays cached (its content is valid) and simply loses its owner."""
        super().free(request_id)
        self._restores.pop(request_id, None)
        spare = self._spare.pop(request_id, None)
        for ckpt, _, _ in self._capturing.pop(request_id, ()):
            self.checkpoints.release(ckpt)
        if spare is not None and spare.owner == request_id:
            spare.owner = None

    def captures_of(self, request_id: str) -> list[Checkpoint]:
        """The request's checkpoints being captured, not yet committed."""
        return [ckpt for ckpt, _, _ in self._capturing.get(request_id, ())]

    def capturing_slots(self) -> set[int]:
        """Checkpoint slots this step's forward writes (captures not yet committed)."""
        return {c.slot for captures in self._capturing.values() for c, _, _ in captures}

    def pins(self) -> Counter[int]:
        """Restores pending this step, per checkpoint slot."""
        return Counter(c.slot for c in self._pinned)

    def is_idle(self) -> bool:
        owned = self.checkpoints is not None and any(c.owner is not None for c in self.checkpoints.checkpoints)
        return not (self._restores or self._pinned or self._capturing or self._spare or owned)
