"""Verification keeps the target's distribution: with a deliberately wrong proposer, the emitted tokens
follow the target's probabilities (chi-square over many draws on a tiny vocabulary)."""

from __future__ import annotations

import torch

from blockserve.sampling_params import SamplingParams
from blockserve.spec_decode.acceptance import num_accepted
from blockserve.worker.model_runner import _verification_rows
from blockserve.worker.sampler import Sampler
from blockserve.worker.sampling_batch import SamplingBatch, SamplingRow

VOCAB = 5
DRAWS = 4000
CHI2_CRITICAL = 18.47  # chi-square with VOCAB - 1 = 4 degrees of freedom, p = 0.001


def test_emitted_tokens_follow_the_target_with_a_wrong_proposer():
    """Position 0's target is p0 and position 1's p1 (the logits do not depend on the prefix); the
    proposer always guesses token 4 (unlikely) then token 0. The first emitted token must follow p0
    whatever the drafts, and the second, when the first draft was accepted, p1."""
    logits0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    logits1 = torch.tensor([0.0, 0.3, 1.5, -0.5, 0.8])
    drafts = [4, 0]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    rows = []
    for _ in range(DRAWS):
        rows += _verification_rows(SamplingRow(params, [1], []), drafts)
    logits = torch.stack([logits0, logits1, logits0] * DRAWS)  # position 2's logits: unused by this check
    sampler = Sampler(device="cpu", seed=7)
    targets = sampler(logits, SamplingBatch.build(rows, "cpu")).token_ids
    first, second = [], []
    for i in range(DRAWS):
        t = targets[3 * i:3 * i + 3]
        emitted = t[:num_accepted(drafts, t) + 1]
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
    for observed, target_logits in ((first, logits0), (second, logits1)):
        counts = torch.bincount(torch.tensor(observed), minlength=VOCAB).double()
        expected = torch.softmax(target_logits.double(), 0) * len(observed)
        assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRITICAL
    assert 0 < len(second) < DRAWS / 10  # the first draft (p ~ 0.03) is accepted now and then


def test_a_seeded_request_draws_the_same_tokens_again():
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))

    def draw():
        generator = torch.Generator().manual_seed(11)
        rows = _verification_rows(SamplingRow(params, [1], [], generator), [2, 3])
        return Sampler(device="cpu")(logits, SamplingBatch.build(rows, "cpu")).token_ids

    assert draw() == draw()
