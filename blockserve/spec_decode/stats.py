"""SpeculationStats: cumulative acceptance figures, read from `stats()` and `/metrics`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationStats:
    """Cumulative since start-up. A verification is one request's draft scored in one step.

    `drafted_per_position[i]` drafts had an i-th token and `accepted_per_position[i]` of those were
    accepted (a token is accepted only if all before it were). `num_skipped` counts the requests'
    steps the engine chose not to speculate (a large batch, or a request's low acceptance)."""

    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: tuple[int, ...] = ()
    accepted_per_position: tuple[int, ...] = ()
    proposer_seconds: float = 0.0
    num_skipped: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position))
