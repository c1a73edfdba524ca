"""What the draft-model and MTP proposers share: drafting through a ModelRunner of their own over a
KVCacheManager of their own, a step's requests batched.

    propose_batch([(request, token_ids, k[, DraftSampling]), ...]):
        _prepare  the subclass's request record (kv.manager.KVRequest) with `token_ids` set to the
                  tokens its rows feed; None: it gets no drafts
        hit       a new record's prefix-cache hit, where the subclass looks one up (`_prefix_hit`)
        allocate  blocks for its rows to feed and k - 1 drafts (a companion of the target's manager
                  holds them already); while they do not fit, the requests that proposed least
                  recently (not this step's) give theirs back (`release`; never a companion's)
        decode    per forward, every request with tokens left to feed (in chunks, at most
                  `max_chunk` tokens in all), then one draft per forward each until it has k
                  (greedy, or drawn under its DraftSampling with the distribution kept for
                  `take_distributions`); the requests leave the runner before it returns
        keep      the rows of its fed tokens, and of the chained drafts only if `keeps_chained_rows`

A model with recurrent-state layers cannot drop a row from its running state: each request's slots
are saved once its own tokens are fed and put back after its drafts were chained through them
(worker/state_rollback.py's StateSnapshots), so its cache holds its tokens only, and its next
proposal feeds again the drafts the target kept. Its fed rows are checkpointed for the prefix cache
where the capture plan says (never a chained draft's).

A request is admitted to the runner for the length of one proposal (re-admitted at the rows its cache
holds, as the target's runner re-admits a preempted request over blocks whose KV is written), so the
runner holds nothing between calls. `forget` (the request ended) frees everything held for it, its
blocks' poison orders applied at once (C2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

import torch

from blockserve.kv.manager import ComputedBlocks, KVCacheManager
from blockserve.kv.pending import PendingWork
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from blockserve.spec_decode.proposer import DraftSampling
from blockserve.structured.matcher import GrammarMatcher
from blockserve.worker.draft_grammar import OutputGrammars
from blockserve.worker.model_runner import ModelRunner
from blockserve.worker.sampling_batch import GREEDY_TEMPERATURE
from blockserve.worker.state_rollback import StateSnapshots

GREEDY = SamplingParams(temperature=0.0)


class RunnerProposer(ABC):
    """Drafts from `runner`'s model over the blocks of `kv`. `max_chunk`: the most tokens one forward
    feeds. Subclasses say which request record a proposal uses (`_prepare`, `_prefix_hit`) and what
    feeds each forward's rows besides tokens (`_feed`, `_chain`)."""

    always_proposes = True  # k drafts for every call, one forward each
    keeps_draft_rows = True  # whether its cache keeps the rows of the drafts it fed back
    caches_prefixes = False  # whether `kv` may have prefix caching on
    what = "the draft model"  # in errors

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_chunk: int):
        if kv.enable_caching and not self.caches_prefixes:
            raise ValueError(f"{self.what}'s KV cache holds rows the target may reject: build it with "
                             "prefix caching off")
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        self.runner, self.kv, self.max_chunk = runner, kv, max_chunk
        runner.keep_distributions = True  # a sampled draft's distribution goes to its verification
        self._requests: OrderedDict = OrderedDict()  # request id -> its record, least recently proposed first
        self._nothing_new = [[] for _ in kv.config.groups]
        self._distributions: dict[str, torch.Tensor] = {}  # the latest sampled drafts' [k, V], until taken
        self._grammars = OutputGrammars()  # constrained requests' matchers, at their output
        # recurrent-state layers: each request's slots after its own tokens, put back after its chain
        self._states = StateSnapshots(runner.layer_caches) if any(g.is_state for g in kv.config.groups) else None

    @property
    def keeps_chained_rows(self) -> bool:
        """Whether a request's cache keeps its chained drafts' rows after a proposal (never with
        recurrent state: its slots are put back to the state after the request's tokens)."""
        return self.keeps_draft_rows and self._states is None

    # -- what a subclass defines -----------------------------------------------------------------

    @abstractmethod
    def _prepare(self, request_id: str, token_ids: Sequence[int], sampling: DraftSampling | None):
        """The request's record, its `token_ids` the tokens its rows feed, its `num_computed_tokens` the
        rows its cache still holds (trimmed to them); None if it cannot propose now."""

    def _prefix_hit(self, request) -> ComputedBlocks | None:
        """A record's prefix-cache hit, taken if its blocks are allocated (None: none looked up)."""
        return None

    def _prompt_offset(self, request) -> int:
        """The request's position of the record's first token."""
        return 0

    def _feed(self, request_id: str, request, row: int, num_rows: int) -> None:
        """Rows [row, row + num_rows) of the record's tokens go into this forward."""

    def _chain(self, request_id: str) -> None:
        """The request's latest draft goes into this forward."""

    def _end_decode(self) -> None:
        """A proposal's forwards are over (or one failed)."""

    # -- the shared loop ---------------------------------------------------------------------------

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int,
                sampling: DraftSampling | None = None) -> list[int]:
        return self.propose_batch([(request_id, token_ids, max_tokens, sampling)]).get(request_id, [])

    def propose_batch(self, asks: Sequence[tuple]) -> dict[str, list[int]]:
        """Drafts for several requests at once, (request id, its tokens, how many drafts[, its
        DraftSampling]) each: their forwards batched, as the target batches its requests. Without a
        DraftSampling (or None) a request's drafts are greedy. A request whose blocks do not fit even
        in an emptied cache gets none."""
        batch: dict[str, tuple] = {}
        for request_id, token_ids, max_tokens, *rest in asks:
            self._distributions.pop(request_id, None)
            if max_tokens <= 0 or not token_ids:
                continue
            sampling = rest[0] if rest else None
            request = self._prepare(request_id, token_ids, sampling)
            if request is None:
                continue
            self._requests.pop(request_id, None)
            self._requests[request_id] = request  # the most recent proposer
            hit = self._prefix_hit(request)
            cached = 0 if hit is None else hit.num_tokens
            to_feed = len(request.token_ids) - request.num_computed_tokens - cached
            if self._allocate(request, to_feed + max_tokens - 1, batch, hit):
                request.num_computed_tokens += cached
                batch[request_id] = (request, token_ids, max_tokens, sampling)
            elif self.kv.allocated_by is None:
                self.release(request_id)  # (a companion's blocks are the target's to free)
        if not batch:
            return {}
        return self._decode(batch)

    def _allocate(self, request, num_tokens: int, keep, hit: ComputedBlocks | None = None) -> bool:
        """Blocks for `num_tokens` more tokens after the prefix-cache hit `hit` (for a companion of the
        target's manager, normally covered already: its allocations follow the target's), taken back from
        the least recently proposing requests (not those in `keep`) while they do not fit (which frees
        blocks, never evicts the hit's; never a companion's, whose blocks are the target's to free); False
        if that cannot make room."""
        while self.kv.allocate_slots(request, num_tokens, hit) is None:
            if self.kv.allocated_by is not None:
                return False
            oldest = next((rid for rid in self._requests if rid != request.request_id and rid not in keep), None)
            if oldest is None:
                return False
            self.release(oldest)
        return True

    def _decode(self, batch: dict[str, tuple]) -> dict[str, list[int]]:
        """Feed each request's tokens past the rows its cache holds (re-admitting it to the runner at that
        many), then decode its drafts; at most `max_chunk` tokens per forward. The requests leave the
        runner before this returns; the chained drafts' rows stay in the cache if `keeps_chained_rows`."""
        row = {rid: request.num_computed_tokens for rid, (request, *_) in batch.items()}
        drafts: dict[str, list[int]] = {rid: [] for rid in batch}
        drawn_from: dict[str, list[torch.Tensor]] = {rid: [] for rid, (*_, sampling) in batch.items()
                                                     if sampling is not None
                                                     and sampling.params.temperature >= GREEDY_TEMPERATURE}
        admitted: set[str] = set()
        completed = False
        try:
            while True:
                step: dict[str, list[int]] = {}
                fed_out: list[str] = []  # requests whose own tokens this forward finishes, drafts to chain
                room = self.max_chunk
                for rid, (request, _, k, _) in batch.items():
                    if room == 0:
                        break
                    if row[rid] < len(request.token_ids):
                        step[rid] = list(request.token_ids[row[rid]:row[rid] + room])
                        self._feed(rid, request, row[rid], len(step[rid]))
                        self.kv.plan_captures(request, row[rid], len(step[rid]))
                        if row[rid] + len(step[rid]) == len(request.token_ids) and k > 1:
                            fed_out.append(rid)
                    elif len(drafts[rid]) < k:
                        step[rid] = drafts[rid][-1:]
                        self._chain(rid)
                    else:
                        continue
                    room -= len(step[rid])
                if not step:
                    break
                new = [self._admission(rid, *batch[rid], row[rid]) for rid in step if rid not in admitted]
                cached = [CachedRequestData(rid, self._nothing_new, row[rid]) for rid in step if rid in admitted]
                admitted.update(step)
                output = self.runner.execute(proposer_step(new, cached, step, self.kv.take_pending()))
                for rid, token_ids in step.items():
                    row[rid] += len(token_ids)
                    drafts[rid] += output.sampled_token_ids[rid]
                    if rid in drawn_from and output.sampled_token_ids[rid]:
                        drawn_from[rid].append(output.distributions[rid])
                if self._states is not None:
                    for rid in fed_out:
                        self._states.save(rid, self.kv.block_ids(rid))
            if self._states is not None:
                self._states.restore_all()
            completed = True
        finally:
            self._end_decode()
            if admitted:
                self.runner.execute(proposer_step([], [], {}, PendingWork(), preempted=admitted))
            if not completed and self._states is not None:  # their slots hold states past their rows
                self._states.clear()
                for rid in batch:
                    self.release(rid)
        for rid, (request, *_) in batch.items():
            if self.keeps_chained_rows:
                request.num_computed_tokens = row[rid]
            else:
                request.num_computed_tokens = min(row[rid], len(request.token_ids))
                self.kv.trim_slots(request, request.num_computed_tokens)
        self._distributions.update((rid, torch.stack(rows)) for rid, rows in drawn_from.items())
        return drafts

    def _admission(self, request_id: str, request, token_ids: Sequence[int], max_tokens: int,
                   sampling: DraftSampling | None, num_computed: int) -> NewRequestData:
        """The request as the runner takes it in, over the record's tokens: greedy without a
        DraftSampling, else split into prompt and output where the request's are (a record that starts
        inside the output sees that output from there on: its penalties then count only those tokens,
        which changes its drafts' distributions, not what verification emits), under the parameters its
        drafts sample with, and a fork of its grammar's matcher at the request's output (which the runner
        advances over each draft) where it is constrained."""
        block_ids = self.kv.block_ids(request_id)
        if sampling is None:
            return NewRequestData(request_id, list(request.token_ids), [], GREEDY, block_ids, num_computed)
        grammar: GrammarMatcher | None = self._grammars.fork(request_id, token_ids, sampling)
        split = max(sampling.num_prompt_tokens - self._prompt_offset(request), 0)
        return NewRequestData(request_id, list(request.token_ids[:split]), list(request.token_ids[split:]),
                              sampling.draft_params(), block_ids, num_computed, sampling.eos_token_id, grammar)

    def drain_pending(self) -> None:
        """Hand the cache's orders recorded outside a proposal to the runner (a companion's: blocks
        allocated, trimmed and freed with the target's), so none wait past the step (C2)."""
        apply_pending(self.runner, self.kv)

    def take_distributions(self, request_id: str) -> torch.Tensor | None:
        """The distributions [k, V] the request's latest drafts were drawn from (None: they were greedy,
        or already taken); the target runner's draft_distributions."""
        return self._distributions.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """Give the request's blocks back (its cache full, or the target preempted it; a companion's the
        target freed already): it feeds its rows again when it next proposes (from a prefix hit where its
        cache has one)."""
        if self._requests.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def forget(self, request_id: str) -> None:
        """The request ended: free its blocks (their poison orders applied at once, C2: nothing pending
        once every request finished), its grammar's matcher and the seeded generator its drafts drew from."""
        self.release(request_id)
        self._distributions.pop(request_id, None)
        self._grammars.forget(request_id)
        apply_pending(self.runner, self.kv, finished={request_id} & self.runner.generators.keys())

    def num_cached_rows(self, request_id: str) -> int:
        """Rows of the request the cache holds (0 for a request it holds nothing for)."""
        request = self._requests.get(request_id)
        return 0 if request is None else request.num_computed_tokens

    @property
    def num_requests(self) -> int:
        """Requests anything is held for."""
        return len(set(self._requests).union(self._distributions, self._grammars))

    def close(self) -> None:
        """Let go of the model and its KV tensors (the engine is closing)."""
        for request_id in list(self._requests):
            self.forget(request_id)
        self.runner = None


def apply_pending(runner: ModelRunner, kv: KVCacheManager, finished: set[str] = frozenset()) -> None:
    """Hand `kv`'s zero and poison orders to `runner`, and `finished` requests' leave (their seeded
    generators), in a step that runs no request; no step when there is neither."""
    if finished or not kv.pending_is_empty():
        runner.execute(proposer_step([], [], {}, kv.take_pending(), finished=finished))


def proposer_step(new: list[NewRequestData], cached: list[CachedRequestData], token_ids: dict[str, list[int]],
                  pending: PendingWork, preempted: set[str] = frozenset(), finished: set[str] = frozenset()
                  ) -> SchedulerOutput:
    """A step for a proposer's own runner: `token_ids` per request (`new` admitted, `cached` running),
    `pending`'s zero, poison, state-copy and state-capture orders, `preempted` leaving the runner and
    `finished` ending."""
    return SchedulerOutput(
        new_requests=new, cached_requests=cached,
        num_scheduled_tokens={rid: len(ids) for rid, ids in token_ids.items()}, scheduled_token_ids=token_ids,
        total_num_scheduled_tokens=sum(len(ids) for ids in token_ids.values()),
        blocks_to_zero=pending.blocks_to_zero, blocks_to_poison=pending.blocks_to_poison,
        finished_request_ids=set(finished), preempted_request_ids=set(preempted), state_copies=pending.state_copies,
        state_captures=pending.state_captures)
