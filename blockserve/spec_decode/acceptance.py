"""The acceptance rule of verification, exact for greedy and sampled requests alike.

The target samples its own token at each of the k + 1 scored positions (position i conditioned on
the request's tokens and drafts[:i]), and the drafts are kept while they equal the target's tokens;
the target's token at the first mismatch (or after the last draft) is emitted too. Every emitted
token is thus drawn from the target's distribution given the tokens emitted before it, whatever the
proposer guessed. For a deterministic proposer (n-gram) this is rejection sampling itself: a draft
x is accepted with probability p(x), and on rejection the token is drawn from p without x,
renormalised, which is max(0, p - q) normalised for a point mass q.

A proposer that samples its drafts (a draft model or MTP head, for a request at temperature > 0)
hands over the distribution q each draft x was drawn from, and the target's row for x emits x with
probability min(1, p(x) / q(x)), else a draw from max(0, p - q) normalised (worker/sampler.py): the
rejection sampling of Leviathan et al. and Chen et al. (2023), which accepts sum_x min(p, q) of the
drafts where comparing with the target's own sample accepts sum_x p q. Either way a row's token is
the draft where it was accepted and a token of p's otherwise, which (if it happens to equal the draft)
is what the next row assumed: the rule below serves both."""

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
