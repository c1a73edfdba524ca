"""The acceptance rule of verification, exact for greedy and sampled requests alike.

The target samples its own token at each of the k + 1 scored positions (position i conditioned on
the request's tokens and drafts[:i]), and the drafts are kept while they equal the target's tokens;
the target's token at the first mismatch (or after the last draft) is emitted too. Every emitted
token is thus drawn from the target's distribution given the tokens emitted before it, whatever the
proposer guessed. For a deterministic proposer (n-gram) this is rejection sampling itself: a draft
x is accepted with probability p(x), and on rejection the token is drawn from p without x,
renormalised, which is max(0, p - q) normalised for a point mass q."""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens (`targets` has one token per draft plus one)."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got {len(targets)}")
    accepted = 0
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        accepted += 1
    return accepted
