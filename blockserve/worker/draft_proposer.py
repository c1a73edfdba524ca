"""Draft-model speculation: a small model with the target's vocabulary decodes the drafts, on its own
paged KV cache, through the engine's own model runner: greedily for a greedy request, else drawn under
the request's own sampling parameters (spec_decode/proposer.py's DraftSampling), each with the
distribution it was drawn from, which the target's verification takes (`take_distributions`) to accept
it by rejection sampling (worker/sampler.py). The request loop, allocation and admission are
worker/runner_proposer.py's.

    propose_batch([(request, token_ids, k), ...]):   (propose: one request)
        valid = the tokens its cache holds that are still the request's (its fed drafts the target
                rejected, and everything after them, are not)
        feed   token_ids[valid:]                 one forward (in chunks for a long prompt), samples d1
        decode d1 .. d(k-1)                      k - 1 one-token forwards, sample d2 .. dk
               (each forward carries every request of the batch that has tokens left to feed)
        now    its cache holds token_ids and d1 .. d(k-1)

The draft's KVCacheManager (zeroed and poisoned like the target's) is the companion of the target's
(kv/manager.py): a request holds draft blocks for as long as it holds target blocks, allocated, trimmed
and freed with them, and the record of a request's first proposal starts from the draft's prefix hit
its admission took. A draft with sliding-window layers allocates on its own (its rows lag the
target's): when its cache is full, the requests that proposed least recently give their draft blocks
back (they re-feed their tokens when they next propose), and a new record (a request's first proposal,
or one that gave its blocks back) looks up its own hit. Either way, with prefix caching on the hit is
on the request's salted hash chain (C6), and after each proposal the full blocks of the request's own
tokens, written by its forwards, are cached (C4); blocks holding its drafts never are.
A draft with recurrent-state layers keeps no drafts' rows (runner_proposer.py): its slots are put
back to the state after the request's tokens after each proposal, and the next one feeds the accepted
drafts again.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockserve.kv.manager import ComputedBlocks
from blockserve.spec_decode.proposer import DraftSampling
from blockserve.worker.runner_proposer import RunnerProposer


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


def _valid_rows(request: _DraftRequest, token_ids: Sequence[int]) -> int:
    """The rows of the record's cache that are still the request's tokens `token_ids` (its fed drafts
    the target kept, not those it rejected or anything after them), short of the last token, which is
    fed again: its forward samples the first draft."""
    valid = request.known
    for draft, token in zip(request.fed_drafts, token_ids[request.known:]):
        if draft != token:
            break
        valid += 1
    return min(valid, len(token_ids) - 1)


class DraftModelProposer(RunnerProposer):
    """Drafts from `runner`'s model over the blocks of `kv` (a KVCacheManager of its own, prefix caching
    on or off). `max_chunk`: the most tokens one forward feeds."""

    caches_prefixes = True  # its KV at a position depends on the request's tokens up to it, as the target's

    def _prepare(self, request_id: str, token_ids: Sequence[int], sampling: DraftSampling | None) -> _DraftRequest:
        """The request's record over `token_ids`, its cache trimmed to the positions still its tokens
        (a request whose tokens shrank, or whose recurrent state is past them, starts over), its hash
        chain salted with the request's salt."""
        request = self._requests.get(request_id)
        valid = -1 if request is None else _valid_rows(request, token_ids)
        if request is None or len(token_ids) < request.known \
                or (valid < request.num_computed_tokens and not self.keeps_chained_rows):
            if request is not None:  # its recurrent state cannot be trimmed: it starts over
                self.kv.free(request_id)
            request = _DraftRequest(request_id, self.kv.new_block_hashes(None if sampling is None
                                                                           else sampling.cache_salt))
            valid = _valid_rows(request, token_ids)
        if valid < request.num_computed_tokens:
            request.num_computed_tokens = valid
            self.kv.trim_slots(request, valid)
        request.token_ids = token_ids
        return request

    def _prefix_hit(self, request: _DraftRequest) -> ComputedBlocks | None:
        """A new record's longest prefix-cache hit (none with caching off): its first `known` tokens. A
        companion took it when the target admitted the request: the record starts at its rows."""
        if request.num_computed_tokens:
            return None
        rows = self.kv.admitted_rows(request.request_id)
        if rows is not None:
            request.known = request.num_computed_tokens = rows
            return None
        if not self.kv.caching_possible:
            return None
        hit = self.kv.get_computed_blocks(request)
        request.known = hit.num_tokens
        return hit

    def propose_batch(self, asks: Sequence[tuple]) -> dict[str, list[int]]:
        """RunnerProposer.propose_batch; each request's cache then holds its tokens and its drafts but the
        last, which the next proposal keeps as far as the target accepted them, and the full blocks of
        its tokens enter the prefix cache (C4: their forwards ran)."""
        drafts = super().propose_batch(asks)
        for request_id, proposed in drafts.items():
            request = self._requests[request_id]
            request.known = len(request.token_ids)
            request.fed_drafts = proposed[:-1] if self.keeps_chained_rows else []
            self.kv.cache_blocks(request, request.known)
        return drafts


