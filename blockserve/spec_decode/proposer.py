"""The interface every proposer implements: draft tokens for one request from what it holds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Guesses the tokens that follow `token_ids` (a request's prompt and output so far). A proposer
    may keep per-request state; `forget` drops it (called when the request ends), and `num_requests`
    counts the requests it still holds state for (0 once every request ended: nothing leaks).

    A proposer may declare `always_proposes = True`: it returns exactly `max_tokens` drafts on every
    call and each costs it work (a draft model's forward), so the speculator decides how many pay
    before asking rather than after; such a proposer may also define `propose_batch(asks)` (asks:
    (request id, tokens, max_tokens) each; returns drafts by request id), then the speculator asks it
    once per step for all requests. `close()`, where defined, releases what it holds."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` draft tokens (possibly none)."""
        ...

    def forget(self, request_id: str) -> None: ...

    @property
    def num_requests(self) -> int: ...
