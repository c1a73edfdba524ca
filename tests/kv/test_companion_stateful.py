"""Random admit / decode / verify / draft / preempt / finish sequences over a target manager and its
companion (a draft model's groups), against a reference of what the draft wrote.

After every allocation the companion covers at least the target's positions (also for a request whose
draft started over, freeing its draft blocks), a verification's trim leaves both tables alike, and
the companion holds blocks only for requests the target holds; an allocation that fails changes
neither manager; a companion hit
hands out blocks holding exactly the request's prefix as the draft wrote it (same salted chain); the
books of both balance (C3), and once everything is freed both are idle.
"""

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockserve.kv import KVCacheConfig, KVCacheGroup, KVCacheManager
from tests.kv.conftest import compute, full, mla, new_req, snapshot

SHARED = list(range(300, 316))
MAX_LEN = 40
prompts = st.builds(lambda k, tail: SHARED[:k] + tail, st.sampled_from([0, 4, 8, 12, 16]),
                    st.lists(st.integers(0, 2), min_size=1, max_size=10))
index = st.integers(0, 255)
salts = st.sampled_from([None, "tenant-b"])


def config(spec, num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig((KVCacheGroup(spec, num_blocks, True, ()),), poison_freed_blocks=True)


class CompanionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.draft = KVCacheManager(config(mla(4), 9))  # smaller than the target's: its blocks run out first
        self.target = KVCacheManager(config(full(4), 12), companion=self.draft)
        self.requests, self.salts = {}, {}
        self.running: set[str] = set()
        self.records: dict = {}  # request id -> the draft's record (its rows)
        self.written: dict[int, tuple] = {}  # draft block id -> (salt, the prefix it completes)
        self.num_added = 0

    def pick(self, ids, i):
        ids = sorted(ids)
        return ids[i % len(ids)]

    def both(self):
        return snapshot(self.target), snapshot(self.draft)

    @rule(prompt=prompts, salt=salts)
    def add_request(self, prompt, salt):
        rid = f"r{self.num_added}"
        self.num_added += 1
        self.requests[rid] = new_req(self.target, rid, prompt, salt)
        self.salts[rid] = salt

    @precondition(lambda self: set(self.requests) - self.running)
    @rule(i=index)
    def admit(self, i):
        req = self.requests[self.pick(set(self.requests) - self.running, i)]
        hit = self.target.get_computed_blocks(req)
        if hit.companion is not None:
            event("admit: draft hit")
            for j, block in enumerate(hit.companion.blocks[0]):
                assert self.written[block.block_id] == (self.salts[req.request_id], tuple(req.token_ids[:4 * (j + 1)]))
        before = self.both()
        if self.target.allocate_slots(req, len(req.token_ids) - hit.num_tokens, hit) is None:
            assert self.both() == before
            event("admit: did not fit")
            return
        req.num_computed_tokens = hit.num_tokens
        compute(self.target, req, len(req.token_ids) - hit.num_tokens)
        self.running.add(req.request_id)
        self.assert_covered(req.request_id)
        record = new_req(self.draft, req.request_id, (), self.salts[req.request_id])
        record.num_computed_tokens = self.draft.admitted_rows(req.request_id)
        assert record.num_computed_tokens == (0 if hit.companion is None else hit.companion.num_tokens)
        self.records[req.request_id] = record

    @precondition(lambda self: self.running)
    @rule(i=index, drafts=st.integers(0, 4), accepted=index)
    def step(self, i, drafts, accepted):
        """A decode step, verifying `drafts` drafts of which some are accepted (the draft writes first)."""
        rid = self.pick(self.running, i)
        req = self.requests[rid]
        if len(req.token_ids) + drafts >= MAX_LEN:
            return
        req.token_ids.append(7)
        if drafts and self.target.reserve_companion(req, 1 + drafts):
            self.draft_writes(rid, drafts)
        else:
            drafts = 0
        before = self.both()
        if self.target.allocate_slots(req, 1 + drafts) is None:
            assert self.both() == before
            event("step: did not fit")
            req.token_ids.pop()
            self.preempt(rid)
            return
        self.assert_covered(rid)
        kept = accepted % (drafts + 1)
        req.num_computed_tokens += 1 + kept
        req.token_ids.extend([8] * kept)
        self.target.trim_slots(req, len(req.token_ids))
        assert len(self.draft.block_ids(rid)[0]) == len(self.target.block_ids(rid)[0])  # rejected drafts: gone from both
        self.target.cache_blocks(req, req.num_computed_tokens)

    def assert_covered(self, rid: str) -> None:
        assert len(self.draft.block_ids(rid)[0]) >= len(self.target.block_ids(rid)[0])

    @precondition(lambda self: self.running)
    @rule(i=index)
    def draft_starts_over(self, i):
        """The draft frees what it holds for a request (a hybrid draft whose state is past its tokens does):
        the target's next allocation covers the request's positions in the draft's groups again."""
        rid = self.pick(self.running, i)
        self.draft.free(rid)
        self.records[rid].num_computed_tokens = 0

    def draft_writes(self, rid: str, drafts: int) -> None:
        """The draft feeds the request's tokens past its rows and chains drafts - 1 more rows: it writes
        within what the companion covers, and caches the full blocks of the request's own tokens."""
        req, record = self.requests[rid], self.records[rid]
        rows = len(req.token_ids)
        assert self.draft.allocate_slots(record, rows + drafts - 1 - record.num_computed_tokens) is not None
        table = self.draft.block_ids(rid)[0]
        assert len(table) * 4 >= rows + drafts - 1
        for j in range(record.num_computed_tokens // 4, rows // 4):
            self.written[table[j]] = (self.salts[rid], tuple(req.token_ids[:4 * (j + 1)]))
        record.token_ids = list(req.token_ids)
        record.num_computed_tokens = rows
        compute(self.draft, record, 0)

    @precondition(lambda self: self.running)
    @rule(i=index)
    def preempt_one(self, i):
        self.preempt(self.pick(self.running, i))

    @precondition(lambda self: self.running)
    @rule(i=index)
    def finish(self, i):
        rid = self.pick(self.running, i)
        self.preempt(rid)
        del self.requests[rid]

    def preempt(self, rid: str) -> None:
        self.target.free(rid)
        self.running.discard(rid)
        self.records.pop(rid, None)
        self.requests[rid].num_computed_tokens = 0
        assert self.draft.block_ids(rid) == [[]]

    @invariant()
    def books_balance(self):
        self.target.check_integrity()
        self.draft.check_integrity()
        target_tables = self.target.coordinator.managers[0].req_blocks
        draft_tables = self.draft.coordinator.managers[0].req_blocks
        assert set(draft_tables) <= set(target_tables) == self.running  # (a draft that started over holds none)
        self.target.take_pending()
        self.draft.take_pending()

    def teardown(self):
        for rid in list(self.running):
            self.target.free(rid)
        self.target.assert_idle()
        self.draft.assert_idle()


TestCompanion = CompanionMachine.TestCase
TestCompanion.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
