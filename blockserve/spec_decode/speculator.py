"""The scheduler's side of speculation: a proposer, when to use it, and the acceptance books.

    schedule():  drafts = speculator.propose(request, room, batch_size)   (may be none)
    update():    speculator.record(request_id, len(drafts), accepted)
    finish:      speculator.forget(request_id)

When speculation does not pay it is switched off: for a step whose running batch reaches
`disable_by_batch_size`, and for a request whose recent drafts were accepted at less than
`min_acceptance_rate` (it waits a number of its steps that doubles each time, then tries again).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from blockserve.spec_decode.config import SpeculativeConfig
from blockserve.spec_decode.ngram import NgramProposer
from blockserve.spec_decode.proposer import Proposer
from blockserve.spec_decode.stats import SpeculationStats

WINDOW_DRAFT_TOKENS = 16  # a request's acceptance is judged over at least this many draft tokens
FIRST_BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 256


@dataclass
class _RequestBooks:
    drafted: int = 0  # in the current window
    accepted: int = 0
    wait: int = 0  # steps left without proposals
    backoff: int = FIRST_BACKOFF_STEPS


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for speculative_config.method {config.method!r}")


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        self.config = config
        self.proposer = proposer or make_proposer(config)
        self._books: dict[str, _RequestBooks] = {}
        k = config.num_speculative_tokens
        self._drafted = [0] * k
        self._accepted = [0] * k
        self._verifications = self._skipped = 0
        self._seconds = 0.0

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int, batch_size: int) -> list[int]:
        """Drafts for the request's next step: at most min(num_speculative_tokens, max_tokens)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and batch_size >= limit:
            self._skipped += 1
            return []
        books = self._books.get(request_id)
        if books is None:
            books = self._books[request_id] = _RequestBooks()
        if books.wait:
            books.wait -= 1
            self._skipped += 1
            return []
        began = time.perf_counter()
        drafts = self.proposer.propose(request_id, token_ids, min(self.config.num_speculative_tokens, max_tokens))
        self._seconds += time.perf_counter() - began
        return drafts

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The target accepted the first `num_accepted` of the request's `num_drafts` drafts."""
        if not 0 <= num_accepted <= num_drafts <= len(self._drafted):
            raise ValueError(f"request {request_id}: {num_accepted} of {num_drafts} drafts accepted")
        self._verifications += 1
        for i in range(num_drafts):
            self._drafted[i] += 1
        for i in range(num_accepted):
            self._accepted[i] += 1
        books = self._books.get(request_id)
        if books is None or self.config.min_acceptance_rate == 0:
            return
        books.drafted += num_drafts
        books.accepted += num_accepted
        if books.drafted >= WINDOW_DRAFT_TOKENS:
            if books.accepted < self.config.min_acceptance_rate * books.drafted:
                books.wait, books.backoff = books.backoff, min(2 * books.backoff, MAX_BACKOFF_STEPS)
            else:
                books.backoff = FIRST_BACKOFF_STEPS
            books.drafted = books.accepted = 0

    def forget(self, request_id: str) -> None:
        """The request ended: drop everything held for it."""
        self._books.pop(request_id, None)
        self.proposer.forget(request_id)

    @property
    def num_requests(self) -> int:
        """Requests something is held for (0 when idle)."""
        return len(self._books) + self.proposer.num_requests

    def stats(self) -> SpeculationStats:
        return SpeculationStats(self._verifications, sum(self._drafted), sum(self._accepted), tuple(self._drafted),
                                tuple(self._accepted), self._seconds, self._skipped)
