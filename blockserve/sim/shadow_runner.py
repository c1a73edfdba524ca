"""A fake model runner that checks every KV read and write against what the cache should hold.

It plays the worker for the real scheduler and KV manager. For each group it keeps a shadow of
every slot of every block: what was written there, as a tag naming the sequence's content up
to that position (so two sequences with the same prefix write the same tags), or ZERO after a
zero order, or nothing. It then fails (raises ShadowViolation) on

  - a read of a slot that should hold this sequence's KV but holds anything else: a stale
    block, another sequence's KV, or a prefix-cache hit whose content differs (C4);
  - a read of an unwritten slot that is neither this sequence's nor zeroed since allocation,
    by a group whose backend declares `reads_unwritten_slots` (C1); for a linear-state group,
    a new request whose state slot is neither zero nor restored to exactly the state of the
    prefix its hit claims (a copy from a checkpoint that holds another prefix, or was poisoned);
  - a write outside the request's blocks, into the null block, or into a block another
    running request also holds; a state capture outside the checkpoint slots, or at a
    position the step does not compute.

State checkpoints are shadow content too: a capture records the state tag of the position it
claims, a copy order moves the tag, and poison orders (poison mode) leave POISON behind.

Sampled tokens are derived from the content tag, so runs are reproducible and a run with
prefix caching must produce exactly the tokens of the same run without it. A request's tags start
from its cache salt, so KV served across tenants (C6) reads as foreign.

With a second tier (`offload`, kv/tiers/), a save order stores a block's slot tags as its payload
and a load order writes them back, so a loaded block is checked like any other: it must hold
exactly the content of the prefix it claims.

Speculative decoding: a request's draft tokens are written as the content they claim; the runner
samples at each draft position and keeps the drafts it agrees with. A rejected draft's slots are
then marked REJECTED (this request's own finite KV, which a whole-block kernel may read in a block's
unwritten tail, weighted by zero), so any later read of them as KV, or a prefix hit on them, fails.
A state group runs through every draft (a capture among them records the drafts' content) and is
then rolled back, as the worker does: its slot holds the state after the last kept token. A
checkpoint captured after a rejected draft holds content no sequence has, so caching it fails the
first restore that reads it.

    slot shadow of one block (block_size 4):  [t17][t18][ZERO][ZERO]
                                               written     zeroed, unwritten
"""

from __future__ import annotations

import ast
import hashlib
from collections import Counter
from collections.abc import Callable, Sequence

from blockserve.kv.block_pool import NULL_BLOCK_ID
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.specs import LinearStateSpec, SlidingWindowSpec
from blockserve.kv.tiers.store import TieredKVStore
from blockserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from blockserve.spec_decode.acceptance import num_accepted

ZERO = "zero"
POISON = "poison"
REJECTED = "rejected"  # with the request id: ("rejected", rid)
_MASK = (1 << 61) - 1


class ShadowViolation(AssertionError):
    """The engine read or wrote KV it should not have."""


def _next_tag(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) & _MASK


def _salt_tag(cache_salt: str | None) -> int:
    """The tag before a request's first token: 0 unsalted, one per salt otherwise."""
    if cache_salt is None:
        return 0
    return int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little") & _MASK


class _SeqState:
    """The runner's view of one request: its tokens, their prefix tags, its block tables."""

    def __init__(self, token_ids: list[int], tables: list[list[int]], cache_salt: str | None = None):
        self.token_ids = list(token_ids)
        self.tags: list[int] = []  # tags[p]: content of tokens[0..p] (after the salt)
        self.tables = tables
        self.cache_salt = cache_salt
        self.origin = _salt_tag(cache_salt)
        self._extend_tags()

    def _extend_tags(self) -> None:
        prev = self.tags[-1] if self.tags else self.origin
        for token in self.token_ids[len(self.tags) :]:
            prev = _next_tag(prev, token)
            self.tags.append(prev)

    def state_tag(self, num_tokens: int):
        """What a recurrent state holds after consuming the first `num_tokens` tokens."""
        return ("state", self.tags[num_tokens - 1]) if num_tokens else ZERO

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        self._extend_tags()


def shadow_continuation(token_ids: Sequence[int], num_tokens: int, vocab_size: int = 1000,
                        cache_salt: str | None = None) -> list[int]:
    """The `num_tokens` tokens a ShadowRunner samples after `token_ids` (for multi-turn streams
    whose next prompt repeats the reply)."""
    seq = _SeqState(list(token_ids), [], cache_salt)
    out = []
    for _ in range(num_tokens):
        out.append(seq.tags[-1] % vocab_size)
        seq.append(out[-1])
    return out


class ShadowRunner:
    def __init__(self, config: KVCacheConfig, reads_unwritten_slots: Sequence[bool], vocab_size: int = 1000,
                 salt_of: Callable[[str], str | None] | None = None, offload: TieredKVStore | None = None):
        """`reads_unwritten_slots[g]` is what group g's backend declares (C1); `salt_of(request id)`: its
        cache salt (default: none); `offload`: the second tier the save orders go to."""
        self.config = config
        self.salt_of = salt_of or (lambda request_id: None)
        self.offload = offload
        self.num_loads = 0
        self.reads_unwritten = list(reads_unwritten_slots)
        self.vocab_size = vocab_size
        self.slots: list[list[list]] = []
        for group in config.groups:
            width = 1 if group.is_state else group.spec.block_size
            self.slots.append([[None] * width for _ in range(group.num_slots)])
        self.seqs: dict[str, _SeqState] = {}
        self.num_steps = 0
        self.num_captures = 0
        self.num_restores = 0
        self.num_rejected = 0  # draft tokens rejected

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for rid in out.finished_request_ids | out.preempted_request_ids:
            self.seqs.pop(rid, None)
        for new in out.new_requests:
            if new.request_id in self.seqs:
                raise ShadowViolation(f"request {new.request_id} scheduled as new while the runner holds it")
            self.seqs[new.request_id] = _SeqState(new.prompt_token_ids + new.output_token_ids, new.block_ids,
                                                  self.salt_of(new.request_id))
        for cached in out.cached_requests:
            seq = self._seq(cached.request_id)
            for table, ids in zip(seq.tables, cached.new_block_ids):
                table.extend(ids)
        # Saves, poison, restores, loads, then zero orders, all before the forward pass that may read them.
        for group_id, orders in out.blocks_to_save.items():
            for block_id, key in orders:
                payload = repr(self.slots[group_id][block_id]).encode()
                if self.offload.has_room(len(payload)):
                    self.offload.submit(key, payload)
                else:
                    self.offload.release(key, len(payload))
        for group_id, block_ids in out.blocks_to_poison.items():
            for block_id in block_ids:
                self.slots[group_id][block_id] = [POISON] * len(self.slots[group_id][block_id])
        for group_id, pairs in out.state_copies.items():
            self.num_restores += len(pairs)
            for src, dst in pairs:
                if src < self.config.groups[group_id].num_blocks or dst >= self.config.groups[group_id].num_blocks:
                    raise ShadowViolation(f"group {group_id}: a restore must copy a checkpoint into a running slot, "
                                          f"got {src} -> {dst}")
                self.slots[group_id][dst] = list(self.slots[group_id][src])
        for group_id, loads in out.blocks_to_load.items():
            self.num_loads += len(loads)
            for block_id, payload in loads:
                if block_id == NULL_BLOCK_ID:
                    raise ShadowViolation(f"group {group_id}: a load into the null block")
                self.slots[group_id][block_id] = ast.literal_eval(payload.decode())
        for group_id, block_ids in out.blocks_to_zero.items():
            for block_id in block_ids:
                self.slots[group_id][block_id] = [ZERO] * len(self.slots[group_id][block_id])

        start_of = {new.request_id: new.num_computed_tokens for new in out.new_requests}
        start_of.update({c.request_id: c.num_computed_tokens for c in out.cached_requests})
        for rid, start in start_of.items():
            self._drop_out_of_window(self.seqs[rid], start)
        holders = self._holders()
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            seq = self._seq(rid)
            start = start_of[rid]
            drafts = out.spec_token_ids.get(rid)
            if drafts is not None:
                sampled[rid] = self._verify(rid, seq, start, n, drafts, holders, out.state_captures)
                continue
            if out.scheduled_token_ids[rid] != seq.token_ids[start : start + n]:
                raise ShadowViolation(f"request {rid}: scheduled tokens differ from the sequence's tokens")
            for group_id, group in enumerate(self.config.groups):
                if group.is_state:
                    self._run_state(group_id, rid, seq, start, n, holders,
                                    out.state_captures.get(group_id, {}).get(rid, ()))
                else:
                    self._run_attention(group_id, rid, seq, start, n, holders)
            if start + n == len(seq.token_ids):
                token = seq.tags[-1] % self.vocab_size
                seq.append(token)
                sampled[rid] = [token]
        return ModelRunnerOutput(sampled)

    def _verify(self, rid: str, seq: _SeqState, start: int, n: int, drafts: list[int], holders,
                captures: dict) -> list[int]:
        """A step that scores `drafts` after the sequence's last token: the drafts' slots are written as
        the content they claim, the target's token is sampled at each position, the agreeing drafts are
        kept, and the rest of the slots are marked REJECTED."""
        if start + n != len(seq.token_ids) + len(drafts) or start + 1 != len(seq.token_ids):
            raise ShadowViolation(f"request {rid}: {len(drafts)} drafts scheduled with {n} tokens from {start}, "
                                  f"but the sequence has {len(seq.token_ids)} tokens")
        claimed = _SeqState(seq.token_ids + drafts, seq.tables, seq.cache_salt)
        targets = [claimed.tags[p] % self.vocab_size for p in range(start, start + n)]
        for group_id, group in enumerate(self.config.groups):
            if group.is_state:  # the state runs through every draft; captures claim the drafts' content
                self._run_state(group_id, rid, claimed, start, n, holders, captures.get(group_id, {}).get(rid, ()))
            else:
                self._run_attention(group_id, rid, claimed, start, n, holders)
        accepted = num_accepted(drafts, targets)
        self.num_rejected += len(drafts) - accepted
        for group_id, group in enumerate(self.config.groups):
            table = seq.tables[group_id]
            if group.is_state:  # the worker's rollback: the slot holds the state after the last kept token
                self.slots[group_id][table[0]] = [claimed.state_tag(start + 1 + accepted)]
                continue
            bs = group.spec.block_size
            for p in range(start + 1 + accepted, start + n):
                self.slots[group_id][table[p // bs]][p % bs] = (REJECTED, rid)
        emitted = targets[:accepted + 1]
        for token in emitted:
            seq.append(token)
        for group, table in zip(self.config.groups, seq.tables):  # as the scheduler's trim_slots frees them
            if not group.is_state:
                del table[-(-len(seq.token_ids) // group.spec.block_size):]
        return emitted

    # -- one request, one group ------------------------------------------------------------------

    def _run_attention(self, group_id: int, rid: str, seq: _SeqState, start: int, n: int, holders) -> None:
        spec = self.config.groups[group_id].spec
        bs = spec.block_size
        table = seq.tables[group_id]
        slots = self.slots[group_id]
        end = start + n
        if len(table) * bs < end:
            raise ShadowViolation(f"request {rid}: group {group_id} table covers {len(table) * bs} tokens, step needs {end}")
        # Read what earlier steps (or a prefix hit) must have left: the window of the first new token.
        first = start - spec.sliding_window + 1 if isinstance(spec, SlidingWindowSpec) else 0
        for p in range(max(0, first), start):
            if slots[table[p // bs]][p % bs] != seq.tags[p]:
                raise ShadowViolation(
                    f"request {rid}: group {group_id} block {table[p // bs]} slot {p % bs} (position {p}) holds "
                    f"{slots[table[p // bs]][p % bs]!r}, not this sequence's KV"
                )
        # Write this step's tokens, each into a block only this request holds.
        for p in range(start, end):
            block_id = table[p // bs]
            if block_id == NULL_BLOCK_ID:
                raise ShadowViolation(f"request {rid}: group {group_id} writes position {p} into the null block")
            if holders[group_id][block_id] > 1:
                raise ShadowViolation(f"request {rid}: group {group_id} writes into block {block_id}, held by others too")
            slots[block_id][p % bs] = seq.tags[p]
        # A whole-block kernel also reads the unwritten tail of the last block.
        if self.reads_unwritten[group_id] and end % bs:
            block_id = table[(end - 1) // bs]
            for offset in range(end % bs, bs):
                if slots[block_id][offset] not in (ZERO, (REJECTED, rid)):
                    raise ShadowViolation(
                        f"request {rid}: group {group_id} reads unwritten slot {offset} of block {block_id}, "
                        f"which holds {slots[block_id][offset]!r} and was not zeroed"
                    )

    def _run_state(self, group_id: int, rid: str, seq: _SeqState, start: int, n: int, holders,
                   captures) -> None:
        group = self.config.groups[group_id]
        spec: LinearStateSpec = group.spec
        table = seq.tables[group_id]
        if len(table) != 1 or table[0] == NULL_BLOCK_ID or table[0] >= group.num_blocks:
            raise ShadowViolation(f"request {rid}: group {group_id} needs exactly one state slot, has {table}")
        slot = self.slots[group_id][table[0]]
        if holders[group_id][table[0]] > 1:
            raise ShadowViolation(f"request {rid}: group {group_id} state slot {table[0]} is shared")
        expected = seq.state_tag(start)
        if slot[0] != expected and not (expected == ZERO and not spec.state_must_start_zeroed):
            raise ShadowViolation(
                f"request {rid}: group {group_id} state slot {table[0]} holds {slot[0]!r}, expected {expected!r}"
            )
        slot[0] = seq.state_tag(start + n)
        for position, checkpoint in captures:
            if not group.num_blocks <= checkpoint < group.num_slots:
                raise ShadowViolation(f"request {rid}: group {group_id} captures into slot {checkpoint}, "
                                      f"not a checkpoint slot")
            if not start < position <= start + n or position % self.config.checkpoint_stride:
                raise ShadowViolation(f"request {rid}: group {group_id} captures position {position}, off the "
                                      f"stride or outside the step's tokens [{start}, {start + n})")
            self.slots[group_id][checkpoint] = [seq.state_tag(position)]
        self.num_captures += len(captures)

    # -- helpers ---------------------------------------------------------------------------------

    def _seq(self, rid: str) -> _SeqState:
        try:
            return self.seqs[rid]
        except KeyError:
            raise ShadowViolation(f"request {rid} scheduled as cached but the runner never saw it") from None

    def _drop_out_of_window(self, seq: _SeqState, start: int) -> None:
        """Forget sliding-window blocks the scheduler released before this step: the scheduler
        never tells the worker about them, because no kernel reads them again."""
        for group, table in zip(self.config.groups, seq.tables):
            if isinstance(group.spec, SlidingWindowSpec):
                for i in range(min(len(table), group.spec.num_skipped_tokens(start) // group.spec.block_size)):
                    table[i] = NULL_BLOCK_ID

    def _holders(self) -> list[Counter]:
        """Per group, how many running requests' tables hold each real block."""
        holders = [Counter() for _ in self.config.groups]
        for seq in self.seqs.values():
            for group_id, table in enumerate(seq.tables):
                holders[group_id].update(b for b in table if b != NULL_BLOCK_ID)
        return holders
