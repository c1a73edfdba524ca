"""Multi-token-prediction speculation: the checkpoint's MTP layer (models/mtp.py) drafts from the target's
own final hidden states, on a paged KV cache of its own, through a ModelRunner of its own: greedily for
a greedy request, else drawn under the request's sampling parameters with the distribution each was
drawn from, as a draft model's (worker/draft_proposer.py); the request loop, allocation and admission
are worker/runner_proposer.py's.

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

from collections import deque
from collections.abc import Sequence

import torch

from blockserve.kv.manager import KVCacheManager
from blockserve.spec_decode.proposer import DraftSampling
from blockserve.worker.model_runner import ModelRunner
from blockserve.worker.runner_proposer import RunnerProposer


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


class MTPProposer(RunnerProposer):
    """Drafts from `runner`'s MultiTokenPredictor over the blocks of `kv` (prefix caching off),
    fed the target states `record` receives (set it as the target runner's hidden_outputs).
    `max_chunk`: the most rows one forward feeds."""

    keeps_draft_rows = False  # a chained row is fed again from the target's state of the token it drafted
    what = "the MTP head"

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_chunk: int):
        super().__init__(runner, kv, max_chunk)
        self.states = TargetStates(MAX_HELD_STATES)
        self._inputs: dict[str, torch.Tensor] = {}  # this forward's hidden inputs per request
        self._chained: dict[str, torch.Tensor] = {}  # each request's last output state
        runner.hidden_inputs = self._hidden_inputs
        runner.hidden_outputs = self._hidden_outputs

    def record(self, request_ids: list[str], query_start: list[int], firsts: list[int], hidden: torch.Tensor) -> None:
        """The target runner's hidden_outputs: see TargetStates.record."""
        self.states.record(request_ids, query_start, firsts, hidden)

    def _prepare(self, request_id: str, token_ids: Sequence[int],
                 sampling: DraftSampling | None) -> _HeadRequest | None:
        """The request's record over its rows up to the target's state of its last token but one; None
        without that state (the target has not computed it). Its cache is trimmed to the rows before that
        position, and a record whose rows would leave a gap before the first target state held starts
        over there."""
        last = len(token_ids) - 2  # the position whose state drafts the token after token_ids
        first = self.states.first(request_id)
        if first is None or last < first or self.states.end(request_id) <= last:
            return None
        request = self._requests.get(request_id)
        if request is not None and request.fed > last:  # no new token since: feed its last row again
            request.num_computed_tokens = max(last - request.start, 0)
            self.kv.trim_slots(request, request.num_computed_tokens)
        if request is None or request.fed < first or request.start > last:  # its rows would leave a gap
            if request is not None:
                self.kv.free(request_id)
            request = _HeadRequest(request_id, self.kv.new_block_hashes(), first)
        request.token_ids = token_ids[request.start + 1:]
        return request

    def _prompt_offset(self, request: _HeadRequest) -> int:
        return request.start + 1

    def _feed(self, request_id: str, request: _HeadRequest, row: int, num_rows: int) -> None:
        begin = request.start + row
        self._inputs[request_id] = self.states.take(request_id, begin, begin + num_rows)

    def _chain(self, request_id: str) -> None:
        self._inputs[request_id] = self._chained[request_id]

    def _end_decode(self) -> None:
        self._inputs.clear()
        self._chained.clear()

    def _hidden_inputs(self, request_ids: list[str], query_start: list[int]) -> torch.Tensor:
        """The head runner's hidden_inputs: this forward's rows' states, in its batch order (taken)."""
        return torch.cat([self._inputs.pop(rid) for rid in request_ids]).to(self.runner.device)

    def _hidden_outputs(self, request_ids: list[str], query_start: list[int], firsts: list[int],
                        hidden: torch.Tensor) -> None:
        """The head runner's hidden_outputs: each request's last row's state, which its next draft chains from."""
        for rid, end in zip(request_ids, query_start[1:]):
            self._chained[rid] = hidden[end - 1:end].clone()

    def forget(self, request_id: str) -> None:
        """The request ended: RunnerProposer.forget, and the target states held for it."""
        self.states.forget(request_id)
        super().forget(request_id)

    @property
    def num_requests(self) -> int:
        return len(set(self._requests).union(self._distributions, self._grammars, self.states.request_ids()))

    def close(self) -> None:
        """Let go of the head, its KV tensors and every target state held (the engine is closing; it
        unsets the target runner's hidden_outputs)."""
        super().close()
        self.states.clear()
