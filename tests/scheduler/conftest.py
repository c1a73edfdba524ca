"""Shared helpers for the scheduler tests: KV layouts, a fake runner, and a `Driver` that runs the
real scheduler over the real KV cache manager and checks every step's SchedulerOutput against
both (budgets, block tables, preemption, C2-C4) so each test only asserts its own scenario."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from blockserve.kv import (
    NULL_BLOCK_ID,
    BlockHashChain,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheManager,
    LinearStateSpec,
    SlidingWindowSpec,
    zero_new_blocks,
)
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler import (
    ModelRunnerOutput,
    Request,
    RequestOutput,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)

BLOCK = 4
FULL = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=8)
SLIDING = SlidingWindowSpec(BLOCK, num_kv_heads=1, head_size=8, sliding_window=6)
STATE = LinearStateSpec(shapes=((2, 4),), dtypes=("float32",))

LAYOUTS = {"full": (FULL,), "full+sliding": (FULL, SLIDING), "full+state": (FULL, STATE)}


def kv_config(
    layout: str = "full",
    num_blocks: int | Iterable[int] = 64,
    *,
    num_slots: int = 64,
    caching: bool = True,
    zero: bool = False,
) -> KVCacheConfig:
    """Blocks per attention group (one number, or one per attention group) and state slots per
    state group, the null block included; zero flags derived as C1 does (`zero`: the backend
    reads unwritten slots)."""
    specs = LAYOUTS[layout]
    sizes = iter([num_blocks] * len(specs) if isinstance(num_blocks, int) else num_blocks)
    groups = tuple(
        KVCacheGroup(spec, num_slots if isinstance(spec, LinearStateSpec) else next(sizes), zero_new_blocks(spec, zero))
        for spec in specs
    )
    return KVCacheConfig(groups, enable_prefix_caching=caching)


def tight_config(layout: str, num_tokens: int, chunk: int, *, caching: bool = True) -> KVCacheConfig:
    """A cache in which one request of `num_tokens` tokens (computed `chunk` at a time) just fits."""
    attention = [s for s in LAYOUTS[layout] if not isinstance(s, LinearStateSpec)]
    return kv_config(layout, [s.max_blocks_held(num_tokens, chunk) + 1 for s in attention], caching=caching)


NextToken = Callable[[Request], int]


def content_token(request: Request) -> int:
    """A token in [1000, 2000) derived from the sequence so far: reproducible, and never one of
    the small ids the tests use as EOS or stop tokens."""
    return 1000 + hash(tuple(request.token_ids)) % 1000


def scripted(script: dict[str, list[int]]) -> NextToken:
    """Request `rid` samples `script[rid][i]` as its i-th output token, `content_token` past that."""

    def next_token(request: Request) -> int:
        tokens = script.get(request.request_id, ())
        i = request.num_output_tokens
        return tokens[i] if i < len(tokens) else content_token(request)

    return next_token


def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


class Driver:
    """The scheduler and a fake runner that samples one token for each scheduled request whose
    tokens are all computed. Every step checks, besides `kv.check_integrity()`:

    - the token budget, max_num_seqs, the chunk cap, and no split prompt without chunked prefill;
    - no step computes a request's last token (sampled, never fed back), nor anything past it;
    - no request both scheduled and preempted; victims hold nothing, are the lowest-priority
      latest-arrived running requests, and wait at the front (FCFS) or in key order (priority);
    - the worker's block tables, built only from whole tables of new requests and appended ids
      of continuing ones, equal `kv.block_ids()` (entries a sliding window dropped read as null);
    - C2: zero and poison orders are drained by every schedule(), and only name new blocks;
    - C4: schedule() never adds to the prefix cache, and every cached block was written by a
      completed step of a request that was still running when its output came back;
    - finished requests hold nothing, and nothing is output after a request finished.

    `ahead`: `run()` drives the scheduler as async scheduling does, each step scheduled before the
    previous one's output is applied (the fake runner samples a step's tokens when it is applied).
    """

    def __init__(self, config: KVCacheConfig, next_token: NextToken = content_token, *, ahead: bool = False,
                 **limits):
        limits.setdefault("max_model_len", 64)
        self.kv = KVCacheManager(config)
        self.scheduler = Scheduler(SchedulerConfig(**limits), self.kv)
        self.next_token = next_token
        self.tables: dict[str, list[list[int]]] = {}  # the worker's view
        self.tokens: dict[str, list[int]] = defaultdict(list)  # output tokens per request
        self.finished: dict[str, RequestOutput] = {}  # last output of each finished request
        self.admitted: list[str] = []  # request ids in order of (re-)admission
        self.history: list[tuple[SchedulerOutput, list[RequestOutput], SchedulerStats]] = []
        self.written: set[bytes] = set()  # hashes of blocks whose KV a completed step wrote
        self.num_preemptions = 0
        self._keys: dict[str, tuple] = {}  # (priority,) arrival, order added: the victim has the largest
        self._num_added = 0
        self._chains: dict[Request, BlockHashChain] = {}  # an independent hash chain per request
        self.ahead = ahead
        self._sampling: dict[int, set[str]] = {}  # per SchedulerOutput (by id): the requests it samples
        self._in_flight: SchedulerOutput | None = None  # ahead: scheduled, its output not yet applied

    # -- requests --------------------------------------------------------------------------------

    def add(self, rid: str, prompt, *, priority: int = 0, arrival: float | None = None,
            eos: int | None = None, salt: str | None = None, **sampling) -> Request:
        """Add a request; by default requests arrive in the order they are added."""
        self._num_added += 1
        seq = self._num_added
        request = Request(rid, list(prompt), SamplingParams(**sampling), eos_token_id=eos,
                          arrival_time=float(seq) if arrival is None else arrival, priority=priority, cache_salt=salt)
        self.scheduler.add_request(request)
        key = (request.arrival_time, seq)
        self._keys[rid] = (priority, *key) if self.scheduler.config.policy == "priority" else key
        self._chains[request] = self.kv.new_block_hashes(salt)
        return request

    def in_use(self) -> list[int]:
        """Blocks (or state slots) in use, per group."""
        return [pool.num_in_use for pool in self.kv.coordinator.pools]

    def cached_hashes(self) -> set[bytes]:
        return {h for pool in self.kv.coordinator.pools for h in pool.cached}

    def waiting_ids(self) -> list[str]:
        return [r.request_id for r in self.scheduler.waiting]

    # -- stepping --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cached_before = self.cached_hashes()
        placeholders = {rid: r.num_output_placeholders for rid, r in self.scheduler.requests.items()}
        out = self.scheduler.schedule()
        self._sampling[id(out)] = {rid for rid in out.num_scheduled_tokens
                                   if self.scheduler.requests[rid].num_output_placeholders > placeholders[rid]}
        self.kv.check_integrity()
        assert self.kv.pending_is_empty(), "schedule() left zero or poison orders behind (C2)"
        assert self.cached_hashes() <= cached_before, "schedule() put blocks in the prefix cache (C4)"
        self._check_batch(out)
        self._check_preemptions(out)
        self._check_tables(out)
        return out

    def update(self, out: SchedulerOutput) -> tuple[list[RequestOutput], SchedulerStats]:
        s = self.scheduler
        sampled = {}
        sampling = self._sampling.pop(id(out))
        starts = {d.request_id: d.num_computed_tokens for d in [*out.new_requests, *out.cached_requests]}
        for rid, n in out.num_scheduled_tokens.items():
            request = s.requests.get(rid)
            if request is None or request.status not in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                continue  # finished or aborted since schedule(): its step's KV must be forgotten (C4)
            if request.status is RequestStatus.RUNNING:  # (a preempted one's blocks are gone)
                chain = self._chains[request]
                for bs in self.kv.config.block_sizes:
                    self.written.update(chain.get(bs, request.token_ids)[: (starts[rid] + n) // bs])
            if rid in sampling:
                sampled[rid] = [self.next_token(request)]
        outputs, stats = s.update_from_output(out, ModelRunnerOutput(sampled))
        self.kv.check_integrity()
        assert self.cached_hashes() <= self.written, "a block entered the prefix cache before its KV was written (C4)"
        for o in outputs:
            assert o.request_id not in self.finished, f"{o.request_id}: output after it finished"
            self.tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                self.finished[o.request_id] = o
                self._keys.pop(o.request_id)
                assert o.request_id not in s.requests and not any(self.kv.block_ids(o.request_id))
        assert stats.num_running == len(s.running) and stats.num_waiting == len(s.waiting)
        assert stats.kv_usage == self.kv.usage() and stats.num_preemptions == self.num_preemptions
        assert stats.num_scheduled_tokens == out.total_num_scheduled_tokens
        self.history.append((out, outputs, stats))
        return outputs, stats

    def step(self) -> tuple[SchedulerOutput, list[RequestOutput], SchedulerStats]:
        out = self.schedule()
        return (out, *self.apply(out))

    def apply(self, out: SchedulerOutput) -> tuple[list[RequestOutput], SchedulerStats]:
        """Apply `out`'s output; ahead, keep `out` in flight and apply the one before it (if any)."""
        if not self.ahead:
            return self.update(out)
        previous, self._in_flight = self._in_flight, (None if out.is_empty else out)
        return ([], self.scheduler.stats()) if previous is None else self.update(previous)

    def abort(self, rids: Iterable[str]) -> list[str]:
        ended = self.scheduler.abort(rids)
        for rid in ended:
            self._keys.pop(rid)
        return ended

    def run(self, max_steps: int = 1000) -> int:
        """Step until nothing is left, then check the scheduler is idle (C2). Returns the steps taken."""
        steps = 0
        while self.scheduler.has_pending_work() or self._in_flight is not None:
            assert steps < max_steps, f"not done after {max_steps} steps"
            self.step()
            steps += 1
        self.scheduler.assert_idle()
        return steps

    # -- the per-step checks ---------------------------------------------------------------------

    def _check_batch(self, out: SchedulerOutput) -> None:
        s, cfg = self.scheduler, self.scheduler.config
        scheduled = out.num_scheduled_tokens
        assert sum(scheduled.values()) == out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        assert not scheduled.keys() & out.preempted_request_ids, "a request was scheduled and preempted in one step"
        entries = [*out.new_requests, *out.cached_requests]
        assert sorted(d.request_id for d in entries) == sorted(scheduled)
        starts = {d.request_id: d.num_computed_tokens for d in entries}
        for rid, n in scheduled.items():
            request = s.requests[rid]
            start = request.num_computed_tokens - n
            assert 1 <= n <= cfg.chunk_cap and start == starts[rid]
            last = min(request.num_prompt_tokens + request.max_output_tokens, cfg.max_model_len) - 1
            assert request.num_computed_tokens <= last, f"{rid}: a step computes past its last token"
            known = request.token_ids[start : start + n]  # ahead, the last may be in flight: -1
            assert out.scheduled_token_ids[rid] == known + [-1] * (n - len(known)) and (self.ahead or len(known) == n)
            if not cfg.enable_chunked_prefill:
                assert request.num_computed_tokens == len(request.token_ids), f"{rid}: prompt split without chunking"

    def _check_preemptions(self, out: SchedulerOutput) -> None:
        s = self.scheduler
        victims = sorted(out.preempted_request_ids, key=self._keys.__getitem__)
        self.num_preemptions += len(victims)
        for rid in victims:
            request = s.requests[rid]
            assert request.status is RequestStatus.PREEMPTED and request.num_computed_tokens == 0
            assert not any(self.kv.block_ids(rid)), f"preempted {rid} still holds blocks"
            assert all(self._keys[r.request_id] < self._keys[rid] for r in s.running), (
                f"{rid} was preempted while a lower-priority or later request kept running"
            )
        waiting = self.waiting_ids()
        if s.config.policy == "fcfs":
            assert waiting[: len(victims)] == victims, f"victims {victims} are not at the front of {waiting}"
        else:
            keys = [self._keys[rid] for rid in waiting]
            assert keys == sorted(keys), f"waiting queue {waiting} is out of (priority, arrival) order"

    def _check_tables(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids | out.preempted_request_ids:
            self.tables.pop(rid, None)  # the worker drops their state
        step_ids: list[set[int]] = [set() for _ in self.kv.config.groups]
        for d in out.new_requests:
            assert d.request_id not in self.tables, f"{d.request_id} is held by the worker but was sent as new"
            assert d.block_ids == self.kv.block_ids(d.request_id), "a new request's table is not whole"
            self.tables[d.request_id] = [list(ids) for ids in d.block_ids]
            self.admitted.append(d.request_id)
            for g, ids in enumerate(d.block_ids):
                step_ids[g].update(ids)
        for d in out.cached_requests:
            for g, (table, ids) in enumerate(zip(self.tables[d.request_id], d.new_block_ids)):
                table.extend(ids)
                step_ids[g].update(ids)
        for request in self.scheduler.running:
            mine, held = self.tables[request.request_id], self.kv.block_ids(request.request_id)
            assert all(
                len(a) == len(b) and all(x == y or y == NULL_BLOCK_ID for x, y in zip(a, b)) for a, b in zip(mine, held)
            ), f"{request.request_id}: worker table {mine} != {held}"
        for g, group in enumerate(self.kv.config.groups):
            zero = out.blocks_to_zero.get(g, [])
            assert len(zero) == len(set(zero)) and set(zero) <= step_ids[g] - {NULL_BLOCK_ID}
            assert group.zero_new_blocks or not zero, f"group {g} got zero orders it does not need"
