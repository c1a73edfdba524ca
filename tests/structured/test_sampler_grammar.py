"""The sampler's grammar mask and logit_bias: applied first (before penalties, temperature and
the filters), to the rows that have them only, never to the caller's logits; min_tokens yields
to the grammar."""

from __future__ import annotations

import pytest
import torch

from blockserve.sampling_params import SamplingParams
from blockserve.worker.sampler import Sampler
from blockserve.worker.sampling_batch import SamplingBatch, SamplingRow, make_generator

CPU = torch.device("cpu")

V = 100  # not a multiple of 32: the last bitmask word is partial
EOS = 2


class AllowOnly:
    """A grammar that allows exactly `ids` (the TokenConstraint the sampler reads)."""

    def __init__(self, ids, vocab_size: int = V):
        self.ids = list(ids)
        self.num_words = (vocab_size + 31) // 32
        self.fills = 0

    def fill_bitmask(self, row: torch.Tensor) -> None:
        assert row.dtype == torch.int32 and row.numel() == self.num_words
        self.fills += 1
        row.zero_()
        for t in self.ids:
            bit = 1 << (t % 32)
            row[t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit


def row(params: SamplingParams, grammar=None, output=(), seed_generator=True) -> SamplingRow:
    generator = make_generator(params.seed, CPU) if params.seed is not None and seed_generator else None
    return SamplingRow(params, [5, 6, 7], list(output), generator, EOS, grammar)


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, V), generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_best_allowed_token_and_the_caller_logits_stay():
    x = logits(2)
    before = x.clone()
    allowed = [31, 63, 95, 99]  # the top bit of three words, and the last column
    sampler = Sampler(device=CPU, seed=0)
    greedy = SamplingParams(temperature=0)
    out = sampler(x, SamplingBatch.build([row(greedy, AllowOnly(allowed)), row(greedy)], CPU))
    assert out.token_ids[0] == allowed[int(x[0, allowed].argmax())]
    assert out.token_ids[1] == int(x[1].argmax())
    assert torch.equal(x, before)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=3),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=4),
    SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=0.5),
])
def test_sampled_tokens_are_always_allowed_and_logprobs_see_the_mask(params):
    allowed = [1, 40, 41, 77]
    sampler = Sampler(device=CPU, seed=0)
    lp_params = SamplingParams(**{**params.__dict__, "logprobs": 3, "logit_bias": ()})
    rows = [row(lp_params, AllowOnly(allowed), output=[40, 40, 77])]
    for step in range(30):
        out = sampler(logits(1, step), SamplingBatch.build(rows, CPU))
        assert out.token_ids[0] in allowed
        entry = out.logprobs[0]
        assert set(entry.top_ids) <= set(allowed)  # forbidden tokens have logprob -inf
        assert abs(sum(torch.tensor(entry.top_logprobs).exp().tolist()) - 1) < 1e-4 or len(entry.top_ids) < 4


def test_unconstrained_rows_get_exactly_what_they_get_alone():
    sampler_a, sampler_b = Sampler(device=CPU, seed=0), Sampler(device=CPU, seed=0)
    plain = [SamplingParams(temperature=0.8, seed=11, logprobs=2), SamplingParams(temperature=0, logprobs=1)]
    x = logits(4, 9)
    alone = sampler_a(x[[1, 3]], SamplingBatch.build([row(p) for p in plain], CPU))
    mixed_rows = [row(SamplingParams(temperature=0), AllowOnly([4])), row(plain[0]),
                  row(SamplingParams(temperature=0.5, seed=1), AllowOnly([8, 9])), row(plain[1])]
    mixed = sampler_b(x, SamplingBatch.build(mixed_rows, CPU))
    assert [mixed.token_ids[1], mixed.token_ids[3]] == alone.token_ids
    assert [mixed.logprobs[1], mixed.logprobs[3]] == alone.logprobs
    assert mixed.token_ids[0] == 4 and mixed.token_ids[2] in (8, 9)


def test_no_constrained_row_no_bitmask_work():
    grammar = AllowOnly([1])
    Sampler(device=CPU, seed=0)(logits(1), SamplingBatch.build([row(SamplingParams(temperature=0))], CPU))
    Sampler(device=CPU, seed=0)(logits(1), SamplingBatch.build([row(SamplingParams(temperature=0), grammar)], CPU))
    assert grammar.fills == 1
    assert SamplingBatch.build([row(SamplingParams())], CPU).grammars == ()


def test_min_tokens_yields_to_a_grammar_that_allows_only_eos():
    params = SamplingParams(temperature=0, min_tokens=5)
    sampler = Sampler(device=CPU, seed=0)
    x = logits(2, 1)
    x[:, EOS] = 100.0  # the model wants to stop
    out = sampler(x, SamplingBatch.build([row(params, AllowOnly([EOS])), row(params, AllowOnly([EOS, 50]))], CPU))
    assert out.token_ids == [EOS, 50]  # alone, EOS wins; with another allowed token, min_tokens still blocks EOS
    unconstrained = sampler(x[:1], SamplingBatch.build([row(params)], CPU))
    without_eos = x[0].clone()
    without_eos[EOS] = float("-inf")
    assert unconstrained.token_ids[0] == int(without_eos.argmax())  # no grammar: min_tokens blocks EOS


def test_logit_bias_moves_the_greedy_choice_and_applies_to_its_row_only():
    x = logits(2, 5)
    best, second = x[0].topk(2).indices.tolist()
    sampler = Sampler(device=CPU, seed=0)
    biased = SamplingParams(temperature=0, logit_bias={best: -100, second: 0.0})
    out = sampler(x, SamplingBatch.build([row(biased), row(SamplingParams(temperature=0))], CPU))
    assert out.token_ids == [second, int(x[1].argmax())]
    pick = SamplingParams(temperature=0, logit_bias={13: 100})
    assert sampler(x, SamplingBatch.build([row(pick)] * 2, CPU)).token_ids == [13, 13]
    # a bias on a token the grammar forbids cannot bring it back
    masked = sampler(x, SamplingBatch.build([row(pick, AllowOnly([20, 21]))] * 2, CPU)).token_ids
    assert set(masked) <= {20, 21}


def test_logit_bias_out_of_the_logits_range_is_an_error():
    with pytest.raises(ValueError, match="logit_bias token 100 is out of range"):
        Sampler(device=CPU, seed=0)(logits(1), SamplingBatch.build([row(SamplingParams(logit_bias={100: 1}))], CPU))


def test_columns_past_the_grammar_vocabulary_are_forbidden():
    x = logits(1, 2)
    x[0, 90] = 1000.0  # a padded logits column the tokenizer (and so the grammar) does not know
    out = Sampler(device=CPU, seed=0)(x, SamplingBatch.build([row(SamplingParams(temperature=0), AllowOnly([10], 40))], CPU))
    assert out.token_ids == [10]
