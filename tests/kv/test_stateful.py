"""Random allocate / hit / decode / preempt / abort / reset sequences against a reference model.

The reference knows, from the ids `allocate_slots` returns, which blocks each request holds;
what each full block was written with (so a hit must hand out exactly the request's prefix);
which blocks were newly given (so the zero orders must be exactly those of flagged groups, C1);
which blocks held content that became garbage (so poison mode poisons them, and only them); and
the prefix cache as the event stream describes it. After every rule the books must balance (C3)
and `take_pending()` drains everything (C2).
"""

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from blockserve.kv import NULL_BLOCK_ID, LinearStateSpec, SlidingWindowSpec
from blockserve.kv.specs import cdiv
from tests.kv.conftest import Req, compute, full, hit_ids, make_manager, mla, new_req, sliding, snapshot, state

SHARED = list(range(100, 116))  # prompts start with a prefix of this, so hits are common
MAX_LEN = 40

prompts = st.builds(
    lambda k, tail: SHARED[:k] + tail,
    st.sampled_from([0, 4, 8, 12, 16]),
    st.lists(st.integers(0, 2), min_size=1, max_size=10),
)
index = st.integers(0, 255)
salts = st.sampled_from([None, "tenant-b"])


class KVCacheMachine(RuleBasedStateMachine):
    GROUPS: tuple  # (spec, num_blocks, zero_new_blocks) per group, set by each configuration
    POISON: bool  # poison mode: freed garbage blocks get poison orders

    def __init__(self):
        super().__init__()
        self.manager = make_manager(*self.GROUPS, poison=self.POISON)
        self.pools = self.manager.coordinator.pools
        self.specs = [g[0] for g in self.GROUPS]
        self.requests: dict[str, Req] = {}
        self.salts: dict[str, str | None] = {}
        self.tables: dict[str, list[list[int]]] = {}  # admitted requests only
        self.given = [[] for _ in self.GROUPS]  # newly given blocks since the last take_pending
        self.written = [{} for _ in self.GROUPS]  # block id -> (salt, the prefix it completes)
        self.captured = [{} for _ in self.GROUPS]  # state groups: checkpoint slot -> (salt, the prefix whose state it holds)
        self.restored: list[list[tuple[int, int]]] = [[] for _ in self.GROUPS]  # copy orders since the last take
        self.cached_ids = [{} for _ in self.GROUPS]  # block id -> its hash, at the last take_pending
        self.garbage = [self.free_uncached(pool) for pool in self.pools]  # free and uncached at the last take
        self.num_added = 0

    # -- helpers ---------------------------------------------------------------------------------

    def waiting(self) -> list[str]:
        return sorted(rid for rid in self.requests if rid not in self.tables)

    def running(self) -> list[str]:
        return sorted(self.tables)

    def can_advance(self) -> list[str]:
        return [rid for rid in self.running() if len(self.requests[rid].token_ids) < MAX_LEN]

    def check_hit(self, req: Req, hit) -> None:
        """A hit is a whole number of every group's blocks, leaves a token, covers the window, and
        holds exactly this request's prefix."""
        assert 0 <= hit.num_tokens < len(req.token_ids)
        if hit.num_tokens == 0:
            return
        assert self.manager.caching_possible
        for g, (spec, blocks) in enumerate(zip(self.specs, hit.blocks)):
            if isinstance(spec, LinearStateSpec):  # one checkpoint, holding exactly this prefix's state
                (checkpoint,) = blocks
                assert checkpoint.position == hit.num_tokens and hit.num_tokens % self.manager.stride == 0
                assert self.captured[g][checkpoint.slot] == (self.salts[req.request_id],
                                                             tuple(req.token_ids[: hit.num_tokens]))
                event("admit: state restored")
                continue
            assert len(blocks) * spec.block_size == hit.num_tokens
            if isinstance(spec, SlidingWindowSpec):  # the window before the first computed token
                first_seen = max(0, hit.num_tokens - spec.sliding_window + 1) // spec.block_size
                assert NULL_BLOCK_ID not in [b.block_id for b in blocks[first_seen:]]
            for i, block in enumerate(blocks):
                if block.block_id != NULL_BLOCK_ID:
                    prefix = tuple(req.token_ids[: (i + 1) * spec.block_size])
                    assert self.written[g][block.block_id] == (self.salts[req.request_id], prefix)

    def compute(self, rid: str, num_tokens: int) -> None:
        """Run the forward pass: record what each newly full block now holds; then every such block
        must be in the prefix cache (C4), under its own id or a twin's holding the same prefix."""
        req = self.requests[rid]
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_tokens
        self.manager.plan_captures(req, start, num_tokens)
        for g, by_request in self.manager._pending.state_captures.items():
            for position, slot in by_request.get(rid, ()):
                assert start < position <= end
                self.captured[g][slot] = (self.salts[rid], tuple(req.token_ids[:position]))
        filled = []
        for g, spec in enumerate(self.specs):
            for i in range(start // spec.block_size, end // spec.block_size) if spec.block_size else ():
                prefix = tuple(req.token_ids[: (i + 1) * spec.block_size])
                self.written[g][self.tables[rid][g][i]] = (self.salts[rid], prefix)
                filled.append((g, req.block_hashes.get(spec.block_size, req.token_ids)[i]))
        compute(self.manager, req, num_tokens)
        assert all(block_hash in self.pools[g].cached for g, block_hash in filled)

    def release_skipped(self, rid: str) -> set[int]:
        """Apply, to the reference, the window's release `allocate_slots` does first; the groups changed."""
        changed = set()
        num_computed = self.requests[rid].num_computed_tokens
        for g, spec in enumerate(self.specs):
            if isinstance(spec, SlidingWindowSpec):
                table = self.tables[rid][g]
                first_seen = max(0, num_computed - spec.sliding_window + 1)  # by the next token
                for i in range(min(first_seen // spec.block_size, len(table))):
                    if table[i] != NULL_BLOCK_ID:
                        table[i] = NULL_BLOCK_ID
                        changed.add(g)
        return changed

    def assert_unchanged(self, before, changed_groups=frozenset()) -> None:
        after = snapshot(self.manager)
        for g in range(len(self.specs)):
            if g not in changed_groups:
                assert (after[0][g], after[1][g]) == (before[0][g], before[1][g])
        assert after[2:] == before[2:]

    def release(self, rid: str) -> None:
        self.manager.free(rid)
        self.tables.pop(rid, None)
        assert self.manager.block_ids(rid) == [[] for _ in self.specs]

    # -- rules -----------------------------------------------------------------------------------

    @rule(prompt=prompts, salt=salts)
    def add_request(self, prompt, salt):
        rid = f"r{self.num_added}"
        self.num_added += 1
        self.requests[rid] = new_req(self.manager, rid, prompt, salt)
        self.salts[rid] = salt

    @initialize(prompt=prompts, salt=salts)
    def first_request(self, prompt, salt):
        self.add_request(prompt, salt)

    @precondition(lambda self: self.waiting())
    @rule(i=index, chunk=st.integers(1, 30))
    def admit(self, i, chunk):
        """Take the prefix hit and allocate (a chunk of) the rest of the prompt."""
        rid = self.waiting()[i % len(self.waiting())]
        req = self.requests[rid]
        hit = self.manager.get_computed_blocks(req)
        self.check_hit(req, hit)
        event(f"admit: {'hit' if hit.num_tokens else 'no hit'}")
        num_new = min(chunk, len(req.token_ids) - hit.num_tokens)
        before = snapshot(self.manager)
        ids = self.manager.allocate_slots(req, num_new, hit)
        event(f"admit: {'fits' if ids else 'does not fit'}")
        if ids is None:
            self.assert_unchanged(before)
            return
        for g, (got, from_hit) in enumerate(zip(ids, hit_ids(hit))):
            assert got[: len(from_hit)] == from_hit
            if isinstance(self.specs[g], LinearStateSpec) and hit.blocks[g]:
                self.restored[g].append((hit.blocks[g][0].slot, got[0]))  # restored: copied, not zeroed (C1)
                continue
            self.given[g] += got[len(from_hit) :]
        self.tables[rid] = ids
        req.num_computed_tokens = hit.num_tokens
        self.compute(rid, num_new)

    @precondition(lambda self: self.can_advance())
    @rule(i=index, chunk=st.integers(1, 8), token=st.integers(0, 2))
    def advance(self, i, chunk, token):
        """Allocate the next prompt chunk, or decode: append a token and allocate one slot."""
        rid = self.can_advance()[i % len(self.can_advance())]
        req = self.requests[rid]
        if req.num_computed_tokens == len(req.token_ids):
            req.token_ids.append(token)
        num_new = min(chunk, len(req.token_ids) - req.num_computed_tokens)
        changed = self.release_skipped(rid)
        before = snapshot(self.manager)
        ids = self.manager.allocate_slots(req, num_new)
        event(f"advance: {'fits' if ids else 'does not fit'}{', window moved' if changed else ''}")
        if ids is None:
            self.assert_unchanged(before, changed)
            return
        for g, new in enumerate(ids):
            self.tables[rid][g] += new
            self.given[g] += new
        self.compute(rid, num_new)

    @precondition(lambda self: self.running())
    @rule(i=index)
    def finish(self, i):
        rid = self.running()[i % len(self.running())]
        self.release(rid)
        del self.requests[rid]

    @precondition(lambda self: self.running())
    @rule(i=index)
    def preempt(self, i):
        """Free everything; the request waits to be recomputed, keeping its tokens."""
        rid = self.running()[i % len(self.running())]
        self.release(rid)
        self.requests[rid].num_computed_tokens = 0

    @precondition(lambda self: self.requests)
    @rule(i=index)
    def abort(self, i):
        rid = sorted(self.requests)[i % len(self.requests)]
        self.release(rid)
        del self.requests[rid]

    @rule()
    def reset_prefix_cache(self):
        before = snapshot(self.manager)
        result = self.manager.reset_prefix_cache()
        assert result.ok == (not self.tables)
        event(f"reset: {'done' if result.ok else 'refused'}")
        if not result.ok:
            self.assert_unchanged(before)
            return
        assert all(not pool.cached for pool in self.pools)
        self.written = [{} for _ in self.specs]
        self.captured = [{} for _ in self.specs]

    # -- after every rule ------------------------------------------------------------------------

    @invariant()
    def books_balance_and_pending_drains(self):
        self.manager.check_integrity()
        for rid in self.requests:
            assert self.manager.block_ids(rid) == self.tables.get(rid, [[] for _ in self.specs])
            if rid in self.tables:
                self.check_table(rid)
        pending = self.manager.take_pending()
        assert self.manager.pending_is_empty()
        flagged = [g for g, group in enumerate(self.GROUPS) if group[2]]
        assert pending.blocks_to_zero == {g: self.given[g] for g in flagged if self.given[g]}
        assert pending.state_copies == {g: r for g, r in enumerate(self.restored) if r}
        self.restored = [[] for _ in self.specs]
        evicted = self.evicted_since_last_take()
        self.check_poison_orders(pending.blocks_to_poison, evicted)
        self.given = [[] for _ in self.specs]
        self.cached_ids = [{i: h for h, twins in pool.cached.items() for i in twins} for pool in self.pools]
        self.garbage = [self.free_uncached(pool) for pool in self.pools]

    def check_table(self, rid: str) -> None:
        """A running request's table has one entry per block of computed tokens (a state group: one)."""
        n = self.requests[rid].num_computed_tokens
        assert [len(t) for t in self.tables[rid]] == [
            cdiv(n, spec.block_size) if spec.block_size else 1 for spec in self.specs
        ]

    def evicted_since_last_take(self) -> list[set[int]]:
        """The block ids cached at the last take whose content has gone since (twins included)."""
        evicted = [{i for i, h in ids.items() if pool.blocks[i].block_hash != h}
                   for ids, pool in zip(self.cached_ids, self.pools)]
        if any(evicted):
            event("evicted")
        return evicted

    @staticmethod
    def free_uncached(pool) -> set[int]:
        return {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is None}

    def check_poison_orders(self, poisoned: dict[int, list[int]], evicted: list[set[int]]) -> None:
        """Poison mode: every block whose content became garbage is poisoned, and no block holding
        content someone may read is (unless it was handed out anew, to be zeroed or rewritten)."""
        if not self.POISON:
            assert poisoned == {}
            return
        for g, pool in enumerate(self.pools):
            orders = set(poisoned.get(g, ()))
            became_garbage = (self.free_uncached(pool) - self.garbage[g]) | evicted[g]
            assert became_garbage <= orders
            assert orders <= self.free_uncached(pool) | set(self.given[g])

    def teardown(self):
        for rid in list(self.requests):
            self.manager.free(rid)
        self.manager.assert_idle()
        assert self.manager.reset_prefix_cache().ok


STATEFUL_SETTINGS = settings(max_examples=300, stateful_step_count=50, deadline=None)


class FullAndSlidingWindow(KVCacheMachine):
    GROUPS = ((full(4), 10, True), (sliding(4, 6), 6, False))
    POISON = True


class MLAAndLinearState(KVCacheMachine):
    GROUPS = ((mla(4), 10, False), (state(), 4, True, 3))  # 3 checkpoint slots, stride 4
    POISON = False


TestFullAndSlidingWindow = FullAndSlidingWindow.TestCase
TestFullAndSlidingWindow.settings = STATEFUL_SETTINGS
TestMLAAndLinearState = MLAAndLinearState.TestCase
TestMLAAndLinearState.settings = STATEFUL_SETTINGS
