"""A proposer for the shadow simulator whose drafts are partly right: the first `right` tokens are
what the ShadowRunner will sample, the rest deliberately wrong, with `right` varying from step to
step (derived from the sequence, so runs are reproducible). Verification must keep exactly the
right ones, and no wrong one may ever be read as KV or cached (C4)."""

from __future__ import annotations

from collections.abc import Sequence

from blockserve.sim.shadow_runner import shadow_continuation


class ShadowProposer:
    def __init__(self, vocab_size: int = 1000):
        self.vocab_size = vocab_size

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        truth = shadow_continuation(token_ids, max_tokens, self.vocab_size)
        right = hash((len(token_ids), token_ids[-1])) % (max_tokens + 1)
        return truth[:right] + [(t + 1) % self.vocab_size for t in truth[right:]]

    def forget(self, request_id: str) -> None:
        """Holds nothing per request."""

    @property
    def num_requests(self) -> int:
        return 0
