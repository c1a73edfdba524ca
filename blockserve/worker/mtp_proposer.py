"""Multi-token-prediction speculation: the checkpoint's MTP layer (models/mtp.py) drafts from the target's
own final hidden states, on a paged KV cache of its own, through a ModelRunner of its own: greedily for
a greedy request, else drawn under the request's sampling parameters with the distribution each was
drawn from, as a draft model's (worker/draft_proposer.py).

    target step   the target's runner hands every computed position's hidden state to `record`
                  (TargetStates: per request, those the head has not taken yet)
    propose_batch([(request, token_ids, k), ...]), N = len(token_ids):
        row j     token x[s+j+1] with the target's h[s+j] (s: the first position the target reported)
        feed      rows for positions fed .. N-2, one forward (in chunks): the last samples d1
        chain     d_i with the head's own output state of the row before -> d_(i+1), for i < k
        then      its cache keeps the rows of positions up to N-2 (from target states); the chained
                  rows are never kept: the next proposal writes those positions again from the
                  target's states of the tokens it accepted

So a rejected draft leaves nothing behind: its position's row is recomputed from the target's state,
and a target state is recorded only for rows the target kept (a verification's rows after the first
rejected draft are replaced by the next step's, which start at the first of them). The head's cache
is its own (a KVCacheManager with prefix caching off, zeroed and poisoned like the target's); its
embedding and, for Qwen3-Next, its lm_head are the target's modules. When its cache is full, the
requests that proposed least recently give their blocks back and feed their rows again later, from
the first target state still held (the rows before are then not attended: drafts only, never the
output), as does a request whose target states outgrew MAX_HELD_STATES before it proposed (a prompt
longer than that, or a request not proposing for that many positions): the states held per request
are bounded by it. Requests enter the head's runner only for the length of
one proposal.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from blockserve.kv.manager import KVCacheManager
from blockserve.kv.pending import PendingWork
from blockserve.scheduler.output import CachedRequestData, NewRequestData
from blockserve.spec_decode.proposer import DraftSampling
from blockserve.structured.matcher import GrammarMatcher
from blockserve.worker.draft_grammar import OutputGrammars
from blockserve.worker.draft_proposer import GREEDY, apply_pending, proposer_step
from blockserve.worker.model_runner import ModelRunner
from blockserve.worker.sampling_batch import GREEDY_TEMPERATURE


MAX_HELD_STATES = 512  # per request, on the target's device and outside the KV plan (hidden_size values
# each): what a request that is drafting holds is only what it has not fed (a step's rows); one that does not
# propose for long (a prompt longer than this, a batch past disable_by_batch_size) keeps its latest states
# only, and its head restarts there, attending those positions only (its drafts, never the output, change)


class TargetStates:
    """Per request, the target's final hidden states of consecutive positions from `first(request)`:
    those the MTP head has not fed yet, and the last one it fed (a proposal with no new token feeds
    it again); at most `max_rows`, the oldest dropped first. Each request's rows are held as the
    chunks its steps recorded, with their count kept alongside: a step costs the rows it records,
    whatever is held."""

    def __init__(self, max_rows: int = MAX_HELD_STATES):
        if max_rows < 2:
            raise ValueError(f"max_rows must be >= 2 (the last fed state and a new one), got {max_rows}")
        self.max_rows = max_rows
        self._first: dict[str, int] = {}
        self._count: dict[str, int] = {}
        self._chunks: dict[str, deque[torch.Tensor]] = {}

    def record(self, request_ids: list[str], query_start: list[int], firsts: list[int], hidden: torch.Tensor) -> None:
        """A target step's hidden states [T, H]: request i's rows query_start[i]:query_start[i + 1], from
        position firsts[i]. They replace what is held from that position on (rejected drafts' rows,
        or the rows of a recomputation); a request whose rows would leave a gap starts over from them."""
        for rid, start, end, first in zip(request_ids, query_start, query_start[1:], firsts):
            rows = hidden[max(start, end - self.max_rows):end].clone()
            first += end - start - rows.shape[0]  # those before the last max_rows would be dropped at once
            held = self._first.get(rid)
            if held is None or not held <= first <= held + self._count[rid]:
                self._first[rid], self._count[rid], self._chunks[rid] = first, 0, deque()
            else:
                self._truncate(rid, first - held)
            if rows.shape[0]:
                self._chunks[rid].append(rows)
                self._count[rid] += rows.shape[0]
            self._drop_oldest(rid, self._count[rid] - self.max_rows)

    def first(self, request_id: str) -> int | None:
        return self._first.get(request_id)

    def end(self, request_id: str) -> int:
        """One past the last position held (first(request) if none)."""
        return self._first.get(request_id, 0) + self._count.get(request_id, 0)

    def num_chunks(self, request_id: str) -> int:
        """How many tensors hold the request's rows."""
        return len(self._chunks.get(request_id, ()))

    def take(self, request_id: str, begin: int, end: int) -> torch.Tensor:
        """The states of positions [begin, end), all held; those before end - 1 are dropped."""
        chunks = self._chunks[request_id]
        rows = torch.cat(tuple(chunks)) if len(chunks) > 1 else chunks[0]
        first = self._first[request_id]
        taken = rows[begin - first:end - first]
        self._first[request_id] = end - 1
        self._count[request_id] -= end - 1 - first
        self._chunks[request_id] = deque([rows[end - 1 - first:]])
        return taken

    def forget(self, request_id: str) -> None:
        self._first.pop(request_id, None)
        self._count.pop(request_id, None)
        self._chunks.pop(request_id, None)

    def clear(self) -> None:
        self._first.clear()
        self._count.clear()
        self._chunks.clear()

    def __len__(self) -> int:
        return len(self._first)

    def request_ids(self):
        return self._first.keys()

    def _drop_oldest(self, request_id: str, excess: int) -> None:
        """Drop the request's first `excess` rows: whole leading chunks, then part of one."""
        if excess <= 0:
            return
        chunks = self._chunks[request_id]
        self._first[request_id] += excess
        self._count[request_id] -= excess
        while excess >= chunks[0].shape[0]:
            excess -= chunks.popleft().shape[0]
        if excess:
            chunks[0] = chunks[0][excess:]

    def _truncate(self, request_id: str, keep: int) -> None:
        """Keep the request's first `keep` rows: drop whole trailing chunks, then part of one."""
        chunks = self._chunks[request_id]
        count = self._count[request_id]
        while chunks and count - chunks[-1].shape[0] >= keep:
            count -= chunks.pop().shape[0]
        if count > keep:
            chunks[-1] = chunks[-1][:chunks[-1].shape[0] - (count - keep)]
        self._count[request_id] = keep


class _HeadRequest:
    """A request as the head's KVCacheManager sees it (kv.manager.KVRequest): its rows."""

    __slots__ = ("request_id", "token_ids", "num_computed_tokens", "block_hashes", "start")

    def __init__(self, request_id: str, block_hashes, start: int):
        self.request_id = request_id
        self.token_ids: Sequence[int] = ()  # the tokens of its rows: the request's from start + 1
        self.num_computed_tokens = 0  # rows its cache holds
        self.block_hashes = block_hashes
        self.start = start  # the target position of row 0

    @property
    def fed(self) -> int:
        """One past the last target position whose row the cache holds."""
        return self.start + self.num_computed_tokens


class MTPProposer:
    """Drafts from `runner`'s MultiTokenPredictor over the blocks of `kv` (prefix caching off),
    fed the target states `record` receives (set it as the target runner's hidden_outputs).
    `max_chunk`: the most rows one forward feeds."""

    always_proposes = True  # k drafts for every call, one forward each

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_chunk: int):
        if kv.enable_caching:
            raise ValueError("the MTP head's KV cache holds chained rows the target may reject: build it with "
                             "prefix caching off")
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        self.runner, self.kv, self.max_chunk = runner, kv, max_chunk
        self.states = TargetStates(MAX_HELD_STATES)
        self._requests: OrderedDict[str, _HeadRequest] = OrderedDict()  # least recently proposed first
        self._nothing_new = [[] for _ in kv.config.groups]
        self._inputs: dict[str, torch.Tensor] = {}  # this forward's hidden inputs per request
        self._chained: dict[str, torch.Tensor] = {}  # each request's last output state
        self._distributions: dict[str, torch.Tensor] = {}  # the latest sampled drafts' [k, V], until taken
        self._grammars = OutputGrammars()  # constrained requests' matchers, at their output
        runner.hidden_inputs = self._hidden_inputs
        runner.hidden_outputs = self._hidden_outputs
        runner.keep_distributions = True  # a sampled draft's distribution goes to its verification

    def record(self, request_ids: list[str], query_start: list[int], firsts: list[int], hidden: torch.Tensor) -> None:
        """The target runner's hidden_outputs: see TargetStates.record."""
        self.states.record(request_ids, query_start, firsts, hidden)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int,
                sampling: DraftSampling | None = None) -> list[int]:
        return self.propose_batch([(request_id, token_ids, max_tokens, sampling)]).get(request_id, [])

    def propose_batch(self, asks: Sequence[tuple]) -> dict[str, list[int]]:
        """Drafts for several requests at once, (request id, its tokens, how many drafts[, its
        DraftSampling]) each, their forwards batched (greedy without a DraftSampling). A request without
        the target's state of its last token but one gets none (the target has not computed it), as
        does one whose rows do not fit an emptied cache."""
        batch: dict[str, tuple[_HeadRequest, Sequence[int], int, DraftSampling | None]] = {}
        for request_id, token_ids, max_tokens, *rest in asks:
            self._distributions.pop(request_id, None)
            last = len(token_ids) - 2  # the position whose state drafts the token after token_ids
            first = self.states.first(request_id)
            if max_tokens <= 0 or first is None or last < first or self.states.end(request_id) <= last:
                continue
            request = self._requests.pop(request_id, None)
            if request is not None and request.fed > last:  # no new token since: feed its last row again
                request.num_computed_tokens = max(last - request.start, 0)
                self.kv.trim_slots(request, request.num_computed_tokens)
            if request is None or request.fed < first or request.start > last:  # its rows would leave a gap
                if request is not None:
                    self.kv.free(request_id)
                request = _HeadRequest(request_id, self.kv.new_block_hashes(), first)
            self._requests[request_id] = request
            request.token_ids = token_ids[request.start + 1:]
            if self._allocate(request, last + 1 - request.fed + max_tokens - 1, batch):
                batch[request_id] = (request, token_ids, max_tokens, rest[0] if rest else None)
            else:
                self._release(request_id)  # its target states stay: it feeds its rows when there is room
        if not batch:
            return {}
        return self._decode(batch)

    def _allocate(self, request: _HeadRequest, num_rows: int, keep) -> bool:
        """Blocks for `num_rows` more rows, taken back from the least recently proposing requests (not
        those in `keep`) while they do not fit; False if that cannot make room."""
        while self.kv.allocate_slots(request, num_rows) is None:
            oldest = next((rid for rid in self._requests if rid != request.request_id and rid not in keep), None)
            if oldest is None:
                return False
            self._release(oldest)
        return True

    def _decode(self, batch: dict[str, tuple[_HeadRequest, Sequence[int], int, DraftSampling | None]]
                ) -> dict[str, list[int]]:
        """Feed each request's rows from the target's states (re-admitting it to the runner at the rows
        its cache holds), then chain its drafts (greedy, or drawn under its DraftSampling: then their
        distributions are kept for `take_distributions`); at most `max_chunk` rows per forward. The
        requests leave the runner, and their cache's chained rows are dropped, before this returns."""
        row = {rid: request.num_computed_tokens for rid, (request, *_) in batch.items()}
        feed_end = {rid: len(token_ids) - 1 - request.start for rid, (request, token_ids, *_) in batch.items()}
        drafts: dict[str, list[int]] = {rid: [] for rid in batch}
        drawn_from: dict[str, list[torch.Tensor]] = {rid: [] for rid, (*_, sampling) in batch.items()
                                                     if sampling is not None
                                                     and sampling.params.temperature >= GREEDY_TEMPERATURE}
        admitted: set[str] = set()
        try:
            while True:
                step: dict[str, list[int]] = {}
                self._inputs.clear()
                room = self.max_chunk
                for rid, (request, _, k, _) in batch.items():
                    if room == 0:
                        break
                    if row[rid] < feed_end[rid]:
                        n = min(feed_end[rid] - row[rid], room)
                        step[rid] = list(request.token_ids[row[rid]:row[rid] + n])
                        begin = request.start + row[rid]
                        self._inputs[rid] = self.states.take(rid, begin, begin + n)
                    elif len(drafts[rid]) < k:
                        step[rid] = drafts[rid][-1:]
                        self._inputs[rid] = self._chained[rid]
                    else:
                        continue
                    room -= len(step[rid])
                if not step:
                    break
                new = [_admission(rid, *batch[rid], self.kv.block_ids(rid), row[rid],
                                  self._grammars.fork(rid, batch[rid][1], batch[rid][3]))
                       for rid in step if rid not in admitted]
                cached = [CachedRequestData(rid, self._nothing_new, row[rid]) for rid in step if rid in admitted]
                admitted.update(step)
                output = self.runner.execute(proposer_step(new, cached, step, self.kv.take_pending()))
                for rid, token_ids in step.items():
                    row[rid] += len(token_ids)
                    drafts[rid] += output.sampled_token_ids[rid]
                    if rid in drawn_from and output.sampled_token_ids[rid]:
                        drawn_from[rid].append(output.distributions[rid])
        finally:
            self._inputs.clear()
            self._chained.clear()
            if admitted:
                self.runner.execute(proposer_step([], [], {}, PendingWork(), preempted=admitted))
        for rid, (request, *_) in batch.items():
            request.num_computed_tokens = min(row[rid], feed_end[rid])  # the chained rows are not kept
            self.kv.trim_slots(request, request.num_computed_tokens)
        self._distributions.update((rid, torch.stack(rows)) for rid, rows in drawn_from.items())
        return drafts

    def take_distributions(self, request_id: str) -> torch.Tensor | None:
        """The distributions [k, V] the request's latest drafts were drawn from (None: they were greedy,
        or already taken); the target runner's draft_distributions."""
        return self._distributions.pop(request_id, None)

    def _hidden_inputs(self, request_ids: list[str], query_start: list[int]) -> torch.Tensor:
        """The head runner's hidden_inputs: this forward's rows' states, in its batch order."""
        return torch.cat([self._inputs[rid] for rid in request_ids]).to(self.runner.device)

    def _hidden_outputs(self, request_ids: list[str], query_start: list[int], firsts: list[int],
                        hidden: torch.Tensor) -> None:
        """The head runner's hidden_outputs: each request's last row's state, which its next draft chains from."""
        for rid, end in zip(request_ids, query_start[1:]):
            self._chained[rid] = hidden[end - 1:end].clone()

    def _release(self, request_id: str) -> None:
        """Give the request's blocks back (its target states stay: it feeds its rows again later)."""
        if self._requests.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def forget(self, request_id: str) -> None:
        """The request ended: free its blocks (their poison orders applied at once, C2), the target
        states held for it and the seeded generator its drafts drew from."""
        self._release(request_id)
        self.states.forget(request_id)
        self._distributions.pop(request_id, None)
        self._grammars.forget(request_id)
        apply_pending(self.runner, self.kv, finished={request_id} & self.runner.generators.keys())

    def num_cached_rows(self, request_id: str) -> int:
        """Rows of the request the head's cache holds (0 for a request it holds nothing for)."""
        request = self._requests.get(request_id)
        return 0 if request is None else request.num_computed_tokens

    @property
    def num_requests(self) -> int:
        return len(set(self._requests).union(self._distributions, self._grammars, self.states.request_ids()))

    def close(self) -> None:
        """Let go of the head, its KV tensors and every target state held (the engine is closing; it
        unsets the target runner's hidden_outputs)."""
        for request_id in list(self._requests):
            self.forget(request_id)
        self.states.clear()
        self.runner = None


def _admission(request_id: str, request: _HeadRequest, token_ids: Sequence[int], max_tokens: int,
               sampling: DraftSampling | None, block_ids, num_computed: int,
               grammar: GrammarMatcher | None) -> NewRequestData:
    """The request as the head's runner takes it in, its rows' tokens (the request's from request.start + 1):
    greedy without a DraftSampling, else split into prompt and output where the request's are (a head that
    starts inside the output sees that output from there on: its penalties then count only those tokens,
    which changes its drafts' distributions, not what verification emits), with `grammar` (a matcher at the
    request's whole output, which the runner advances over each draft) where it is constrained."""
    if sampling is None:
        return NewRequestData(request_id, list(request.token_ids), [], GREEDY, block_ids, num_computed)
    split = max(sampling.num_prompt_tokens - request.start - 1, 0)
    return NewRequestData(request_id, list(request.token_ids[:split]), list(request.token_ids[split:]),
                          sampling.draft_params(), block_ids, num_computed, sampling.eos_token_id, grammar)
