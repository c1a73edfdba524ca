"""Draft-model speculation: a small model with the target's vocabulary decodes the drafts, on its own
paged KV cache, through the engine's own model runner: greedily for a greedy request, else drawn under
the request's own sampling parameters (spec_decode/proposer.py's DraftSampling), each with the
distribution it was drawn from, which the target's verification takes (`take_distributions`) to accept
it by rejection sampling (worker/sampler.py).

    propose_batch([(request, token_ids, k), ...]):   (propose: one request)
        valid = the tokens its cache holds that are still the request's (its fed drafts the target
                rejected, and everything after them, are not)
        feed   token_ids[valid:]                 one forward (in chunks for a long prompt), samples d1
        decode d1 .. d(k-1)                      k - 1 one-token forwards, sample d2 .. dk
               (each forward carries every request of the batch that has tokens left to feed)
        now    its cache holds token_ids and d1 .. d(k-1)

Each request owns blocks in the draft's KVCacheManager (zeroed and poisoned like the target's) for
as long as it is running; `forget` frees them. A request is admitted to the draft's runner for the
length of one proposal (re-admitted at its valid length, as the target's runner re-admits a
preempted request over blocks whose KV is already written) and released before it returns, so the
runner holds nothing between calls. When the draft's cache is full, the requests that proposed
least recently give their draft blocks back (they re-feed their tokens when they next propose).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from blockserve.kv.manager import KVCacheManager
from blockserve.kv.pending import PendingWork
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from blockserve.spec_decode.proposer import DraftSampling
from blockserve.structured.matcher import GrammarMatcher
from blockserve.worker.draft_grammar import OutputGrammars
from blockserve.worker.model_runner import ModelRunner
from blockserve.worker.sampling_batch import GREEDY_TEMPERATURE

GREEDY = SamplingParams(temperature=0.0)


class _DraftRequest:
    """A request as the draft's KVCacheManager sees it (kv.manager.KVRequest)."""

    __slots__ = ("request_id", "token_ids", "num_computed_tokens", "block_hashes", "known", "fed_drafts")

    def __init__(self, request_id: str, block_hashes):
        self.request_id = request_id
        self.token_ids: Sequence[int] = ()  # the request's tokens at its latest proposal
        self.num_computed_tokens = 0  # positions whose KV the draft's cache holds
        self.block_hashes = block_hashes
        self.known = 0  # of those, the first `known` are the request's own tokens...
        self.fed_drafts: list[int] = []  # ...and the rest these drafts, which the target may have rejected


def check_draft_vocabulary(target_hf_config, target_tokenizer, draft_hf_config, draft_tokenizer) -> None:
    """ValueError naming speculative_config.model when the draft cannot propose the target's tokens:
    a different vocabulary size, or (where both ship a tokenizer) a different vocabulary."""
    target_size, draft_size = target_hf_config.vocab_size, draft_hf_config.vocab_size
    if target_size != draft_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft_size} tokens, the target's "
                         f"{target_size}; give a draft model that shares the target's tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None \
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError("speculative_config.model: the draft's tokenizer maps tokens to other ids than the "
                         "target's; give a draft model that shares the target's tokenizer")


class DraftModelProposer:
    """Drafts from `runner`'s model over the blocks of `kv` (a KVCacheManager of its own, prefix caching
    off). `max_chunk`: the most tokens one forward feeds."""

    always_proposes = True  # k drafts for every call, one forward each

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_chunk: int):
        if kv.enable_caching:
            raise ValueError("the draft model's KV cache holds drafts the target may reject: build it with "
                             "prefix caching off")
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        self.runner, self.kv, self.max_chunk = runner, kv, max_chunk
        runner.keep_distributions = True  # a sampled draft's distribution goes to its verification
        self._requests: OrderedDict[str, _DraftRequest] = OrderedDict()  # least recently proposed first
        self._nothing_new = [[] for _ in kv.config.groups]
        self._distributions: dict[str, torch.Tensor] = {}  # the latest sampled drafts' [k, V], until taken
        self._grammars = OutputGrammars()  # constrained requests' matchers, at their output

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int,
                sampling: DraftSampling | None = None) -> list[int]:
        return self.propose_batch([(request_id, token_ids, max_tokens, sampling)]).get(request_id, [])

    def propose_batch(self, asks: Sequence[tuple]) -> dict[str, list[int]]:
        """Drafts for several requests at once, (request id, its tokens, how many drafts[, its
        DraftSampling]) each: their forwards batched, as the target batches its requests. Without a
        DraftSampling (or None) a request's drafts are greedy. A request whose blocks do not fit even in
        an emptied draft cache gets none."""
        batch: dict[str, tuple[_DraftRequest, Sequence[int], int, DraftSampling | None]] = {}
        for request_id, token_ids, max_tokens, *rest in asks:
            self._distributions.pop(request_id, None)
            if max_tokens <= 0 or not token_ids:
                continue
            request = self._requests.pop(request_id, None)
            if request is None or len(token_ids) < request.known:
                if request is not None:
                    self.kv.free(request_id)
                request = _DraftRequest(request_id, self.kv.new_block_hashes())
            self._requests[request_id] = request
            valid = request.known
            for draft, token in zip(request.fed_drafts, token_ids[request.known:]):
                if draft != token:
                    break
                valid += 1
            valid = min(valid, len(token_ids) - 1)  # the last token is fed again: its forward samples d1
            if valid < request.num_computed_tokens:
                request.num_computed_tokens = valid
                self.kv.trim_slots(request, valid)
            request.token_ids = token_ids
            if self._allocate(request, len(token_ids) - valid + max_tokens - 1, batch):
                batch[request_id] = (request, token_ids, max_tokens, rest[0] if rest else None)
            else:
                self.forget(request_id)
        if not batch:
            return {}
        drafts = self._decode(batch)
        for request_id, (request, token_ids, *_) in batch.items():
            request.known, request.fed_drafts = len(token_ids), drafts[request_id][:-1]
        return drafts

    def _allocate(self, request: _DraftRequest, num_tokens: int, keep) -> bool:
        """Blocks for `num_tokens` more tokens, taken back from the least recently proposing requests
        (not those in `keep`) while they do not fit; False if that cannot make room."""
        while self.kv.allocate_slots(request, num_tokens) is None:
            oldest = next((rid for rid in self._requests if rid != request.request_id and rid not in keep), None)
            if oldest is None:
                return False
            self.forget(oldest)
        return True

    def _decode(self, batch: dict[str, tuple[_DraftRequest, Sequence[int], int, DraftSampling | None]]
                ) -> dict[str, list[int]]:
        """Feed each request's tokens past those its cache holds (re-admitting it to the runner at that
        many computed tokens), then decode its drafts (greedy, or drawn under its DraftSampling: then
        their distributions are kept for `take_distributions`); at most `max_chunk` tokens per forward.
        The requests leave the runner before this returns."""
        position = {rid: request.num_computed_tokens for rid, (request, *_) in batch.items()}
        drafts: dict[str, list[int]] = {rid: [] for rid in batch}
        drawn_from: dict[str, list[torch.Tensor]] = {rid: [] for rid, (*_, sampling) in batch.items()
                                                     if sampling is not None
                                                     and sampling.params.temperature >= GREEDY_TEMPERATURE}
        admitted: set[str] = set()
        try:
            while True:
                step: dict[str, list[int]] = {}
                room = self.max_chunk
                for rid, (_, token_ids, k, _) in batch.items():
                    if room == 0:
                        break
                    if position[rid] < len(token_ids):
                        step[rid] = list(token_ids[position[rid]:position[rid] + room])
                    elif len(drafts[rid]) < k:
                        step[rid] = drafts[rid][-1:]
                    else:
                        continue
                    room -= len(step[rid])
                if not step:
                    break
                new = [_admission(rid, batch[rid][1], batch[rid][3], self.kv.block_ids(rid), position[rid],
                                  self._grammars.fork(rid, batch[rid][1], batch[rid][3]))
                       for rid in step if rid not in admitted]
                cached = [CachedRequestData(rid, self._nothing_new, position[rid]) for rid in step if rid in admitted]
                admitted.update(step)
                output = self.runner.execute(proposer_step(new, cached, step, self.kv.take_pending()))
                for rid, token_ids in step.items():
                    position[rid] += len(token_ids)
                    drafts[rid] += output.sampled_token_ids[rid]
                    if rid in drawn_from and output.sampled_token_ids[rid]:
                        drawn_from[rid].append(output.distributions[rid])
        finally:
            if admitted:
                self.runner.execute(proposer_step([], [], {}, PendingWork(), preempted=admitted))
        for rid, (request, *_) in batch.items():
            request.num_computed_tokens = position[rid]
        self._distributions.update((rid, torch.stack(rows)) for rid, rows in drawn_from.items())
        return drafts

    def take_distributions(self, request_id: str) -> torch.Tensor | None:
        """The distributions [k, V] the request's latest drafts were drawn from (None: they were greedy,
        or already taken); the target runner's draft_distributions."""
        return self._distributions.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request ended (or gives its draft blocks back): free them, their poison orders applied at
        once (C2: nothing pending once every request finished), and the seeded generator its drafts
        drew from."""
        self._distributions.pop(request_id, None)
        self._grammars.forget(request_id)
        if self._requests.pop(request_id, None) is not None:
            self.kv.free(request_id)
        apply_pending(self.runner, self.kv, finished={request_id} & self.runner.generators.keys())

    def num_cached_tokens(self, request_id: str) -> int:
        """Positions of the request the draft's cache holds (0 for a request it holds nothing for)."""
        request = self._requests.get(request_id)
        return 0 if request is None else request.num_computed_tokens

    @property
    def num_requests(self) -> int:
        return len(set(self._requests).union(self._distributions, self._grammars))

    def close(self) -> None:
        """Let go of the draft model and its KV tensors (the engine is closing)."""
        for request_id in list(self._requests):
            self.forget(request_id)
        self.runner = None


def _admission(request_id: str, token_ids: Sequence[int], sampling: DraftSampling | None, block_ids,
               num_computed: int, grammar: GrammarMatcher | None) -> NewRequestData:
    """The request as the draft's runner takes it in: greedy over all its tokens without a DraftSampling,
    else its prompt, output and the parameters its drafts sample under, and `grammar` (a matcher at its
    output, which the runner advances over each draft) where it is constrained."""
    if sampling is None:
        return NewRequestData(request_id, list(token_ids), [], GREEDY, block_ids, num_computed)
    split = sampling.num_prompt_tokens
    return NewRequestData(request_id, list(token_ids[:split]), list(token_ids[split:]), sampling.draft_params(),
                          block_ids, num_computed, sampling.eos_token_id, grammar)


def apply_pending(runner: ModelRunner, kv: KVCacheManager, finished: set[str] = frozenset()) -> None:
    """Hand `kv`'s zero and poison orders to `runner`, and `finished` requests' leave (their seeded
    generators), in a step that runs no request; no step when there is neither."""
    if finished or not kv.pending_is_empty():
        runner.execute(proposer_step([], [], {}, kv.take_pending(), finished=finished))


def proposer_step(new: list[NewRequestData], cached: list[CachedRequestData], token_ids: dict[str, list[int]],
                  pending: PendingWork, preempted: set[str] = frozenset(), finished: set[str] = frozenset()
                  ) -> SchedulerOutput:
    """A step for a proposer's own runner: `token_ids` per request (`new` admitted, `cached` running),
    `pending`'s zero, poison and state-copy orders, `preempted` leaving the runner and `finished` ending."""
    return SchedulerOutput(
        new_requests=new, cached_requests=cached,
        num_scheduled_tokens={rid: len(ids) for rid, ids in token_ids.items()}, scheduled_token_ids=token_ids,
        total_num_scheduled_tokens=sum(len(ids) for ids in token_ids.values()),
        blocks_to_zero=pending.blocks_to_zero, blocks_to_poison=pending.blocks_to_poison,
        finished_request_ids=set(finished), preempted_request_ids=set(preempted), state_copies=pending.state_copies)
