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


def _sampled_verifications(p_logits: list[torch.Tensor], q: list[torch.Tensor], draws: int, seed: int,
                           distributions: bool = True) -> tuple[list[list[int]], list[list[int]]]:
    """`draws` verifications of k = len(q) drafts, each draft drawn from its q (the positions' targets do
    not depend on the prefix); with `distributions`, verified by rejection sampling, else by equality.
    Returns (the drafts, the tokens emitted) of each."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    generator = torch.Generator().manual_seed(seed)
    all_drafts = [[int(torch.multinomial(qi, 1, generator=generator)) for qi in q] for _ in range(draws)]
    q_rows = torch.stack(q)
    rows = []
    for drafts in all_drafts:
        rows += _verification_rows(SamplingRow(params, [1], []), drafts, q_rows if distributions else None)
    logits = torch.stack(p_logits * draws)
    targets = Sampler(device="cpu", seed=seed)(logits, SamplingBatch.build(rows, "cpu")).token_ids
    width = len(q) + 1
    emitted = [t[:num_accepted(d, t) + 1] for d, t in
               ((d, targets[width * i:width * (i + 1)]) for i, d in enumerate(all_drafts))]
    return all_drafts, emitted


def _chi2(observed: list[int], target_logits: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(observed), minlength=VOCAB).double()
    expected = torch.softmax(target_logits.double(), 0) * len(observed)
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_drafts_emit_the_target_distribution_with_a_different_draft():
    """Drafts drawn from q, far from the target's p (q favours the tokens p finds unlikely), verified by
    rejection sampling: the first emitted token follows p0, the second p1; the first draft is accepted
    at the rate sum_x min(p0, q0)."""
    logits0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    logits1 = torch.tensor([0.0, 0.3, 1.5, -0.5, 0.8])
    q0 = torch.tensor([0.05, 0.05, 0.2, 0.3, 0.4])
    q1 = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    drafts, emitted = _sampled_verifications([logits0, logits1, logits0], [q0, q1], DRAWS, seed=7)
    assert _chi2([e[0] for e in emitted], logits0) < CHI2_CRITICAL
    assert _chi2([e[1] for e in emitted if len(e) > 1], logits1) < CHI2_CRITICAL
    accepted = sum(e[0] == d[0] for d, e in zip(drafts, emitted)) / DRAWS
    expected = float(torch.minimum(torch.softmax(logits0, 0), q0).sum())  # about 0.35
    assert abs(accepted - expected) < 0.035  # 4.6 standard deviations of DRAWS Bernoulli trials


def test_sampled_drafts_from_the_target_itself_are_all_accepted():
    """q = p: every draft is accepted, where comparing the target's own sample with a draft accepts it
    with probability sum p^2 only."""
    logits = torch.tensor([0.4, 0.0, 0.3, -0.2, 0.1])
    p = torch.softmax(logits, 0)
    _, sampled = _sampled_verifications([logits] * 3, [p, p], 1000, seed=5)
    _, compared = _sampled_verifications([logits] * 3, [p, p], 1000, seed=5, distributions=False)
    assert all(len(e) == 3 for e in sampled)
    first_accepted = sum(len(e) > 1 for e in compared) / 1000
    assert abs(first_accepted - float((p * p).sum())) < 0.07  # about 0.21
    assert _chi2([e[0] for e in sampled] + [e[1] for e in sampled], logits) < CHI2_CRITICAL


def test_a_draft_the_target_cannot_emit_is_never_accepted():
    """Top-k 2 at the target: a draft outside its two most likely tokens (drawn from a q without that
    filter) is always replaced by a token of the residual, inside them."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=8)
    q = torch.full((2, VOCAB), 1.0 / VOCAB)
    rows = []
    for _ in range(500):
        rows += _verification_rows(SamplingRow(params, [1], []), [4, 4], q)
    targets = Sampler(device="cpu", seed=1)(torch.stack([logits] * 1500), SamplingBatch.build(rows, "cpu")).token_ids
    assert set(targets[0::3]) == {0, 1}


def test_a_seeded_request_verifies_its_sampled_drafts_the_same_way_again():
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    q = torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)), 1)

    def draw(sampler_seed: int):
        generator = torch.Generator().manual_seed(11)
        tokens = []
        for _ in range(50):
            rows = _verification_rows(SamplingRow(params, [1], [], generator), [2, 3], q)
            tokens += Sampler(device="cpu", seed=sampler_seed)(logits, SamplingBatch.build(rows, "cpu")).token_ids
        return tokens

    assert draw(1) == draw(2)  # its own generator, whatever the sampler's
    assert len(set(draw(1))) > 1
