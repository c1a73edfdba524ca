"""The interface every proposer implements: draft tokens for one request from what it holds."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from blockserve.sampling_params import SamplingParams


class Proposer(Protocol):
    """Guesses the tokens that follow `token_ids` (a request's prompt and output so far). A proposer
    may keep per-request state; `forget` drops it (called when the request ends), and `num_requests`
    counts the requests it still holds state for (0 once every request ended: nothing leaks).

    A proposer may declare `always_proposes = True`: it returns exactly `max_tokens` drafts on every
    call and each costs it work (a draft model's forward), so the speculator decides how many pay
    before asking rather than after; such a proposer may also define `propose_batch(asks)` (asks:
    (request id, tokens, max_tokens) each; returns drafts by request id), then the speculator asks it
    once per step for all requests; an ask may carry a fourth element, the request's DraftSampling
    (None: draft greedily). `release(request_id)`, where defined, gives back what a preempted request
    holds in the proposer's own KV cache; `close()`, where defined, releases what it holds."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` draft tokens (possibly none)."""
        ...

    def forget(self, request_id: str) -> None: ...

    @property
    def num_requests(self) -> int: ...


@dataclass(frozen=True)
class DraftSampling:
    """How a request samples its tokens, for a proposer that samples its drafts as the target samples them
    (a draft model, an MTP head): its parameters, and where its output starts among its tokens; and its
    `cache_salt`, which keys a proposer's own prefix cache as it keys the target's (C6)."""

    params: SamplingParams
    num_prompt_tokens: int
    eos_token_id: int | None = None
    cache_salt: str | None = None

    def draft_params(self) -> SamplingParams:
        """The parameters a draft samples under: the request's temperature, filters, penalties, logit_bias and
        min_tokens (so its distribution is comparable with the target's); no logprobs; a seed derived from
        the request's (its own stream, independent of the draws that verify it). Its grammar is not among
        them: a draft's runner takes a matcher already at the request's output (worker/draft_grammar.py)."""
        return dataclasses.replace(self.params, logprobs=None, prompt_logprobs=None, seed=draft_seed(self.params.seed),
                                   structured_outputs=None)


def draft_seed(seed: int | None) -> int | None:
    """The seed a draft's random stream takes from the target's (a request's, or the engine's for its
    proposer runner): a different stream, so no number that verifies a draft also drew one (rejection
    sampling needs the two independent). None stays None."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"draft:{seed}".encode()).digest()[:8], "little") >> 1
