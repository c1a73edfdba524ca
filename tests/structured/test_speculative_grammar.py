"""The grammar under speculation, on a five-token vocabulary: each verified position's mask is the
grammar's after the drafts before it, computed without moving the request's matcher; a draft the
grammar refuses cuts the proposal and is never accepted; sampled verification keeps the target's
distribution under the mask (chi-square over many draws)."""

from __future__ import annotations

import llguidance
import pytest
import torch

from blockserve.sampling_params import SamplingParams
from blockserve.spec_decode.acceptance import num_accepted
from blockserve.spec_decode.grammar_cut import DraftGrammar
from blockserve.structured.compiler import CompiledGrammar
from blockserve.structured.matcher import GrammarMatcher
from blockserve.worker.model_runner import _verification_rows
from blockserve.worker.sampler import Sampler
from blockserve.worker.sampling_batch import SamplingBatch, SamplingRow

EOS, A, B, C, D = range(5)
VOCAB = 5
DRAWS = 4000
CHI2_CRITICAL = 13.82  # chi-square with 2 degrees of freedom (3 allowed tokens), p = 0.001


class _Letters:
    """A tokenizer of four one-letter tokens and EOS (llguidance's generic tokenizer interface)."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [b"<eos>", b"a", b"b", b"c", b"d"]
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return [b"abcd".index(bytes([ch])) + 1 for ch in text]


def compiled(regex: str = "[abc][bcd]+") -> CompiledGrammar:
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Letters()))
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return CompiledGrammar("regex", matcher, VOCAB, EOS)


def allowed(mask) -> set[int]:
    row = torch.zeros(1, dtype=torch.int32)
    mask.fill_bitmask(row)
    return {t for t in range(VOCAB) if (int(row[0]) >> t) & 1}


def test_masks_follow_the_drafts_and_the_matcher_stays_where_it_was():
    grammar = compiled()
    matcher = GrammarMatcher(grammar, [A])
    before = allowed(matcher)
    masks, valid = matcher.draft_masks([B, C, A, D])  # A is refused after "abc"
    assert valid == 2 and DraftGrammar(grammar).valid_drafts([A], [B, C, A, D]) == 2  # the scheduler's cut
    assert len(masks) == 5
    for i, mask in enumerate(masks[:3]):  # position i: the grammar after the output and drafts[:i]
        assert allowed(mask) == allowed(GrammarMatcher(grammar, [A, B, C][:i + 1]))
    assert allowed(masks[3]) == allowed(masks[4]) == allowed(masks[2])  # past the refused draft: repeated
    assert A not in allowed(masks[2])  # so the refused draft is never sampled there
    assert matcher.num_accepted == 1 and allowed(matcher) == before == {B, C, D}


def test_a_refused_first_draft_leaves_no_draft():
    grammar = compiled()
    masks, valid = GrammarMatcher(grammar, []).draft_masks([D, A])  # "d" cannot start
    assert valid == 0
    assert [allowed(m) for m in masks] == [{A, B, C}] * 3


def test_the_scheduler_cut_follows_the_output_and_refuses_a_shrinking_one():
    cut = DraftGrammar(compiled())
    assert cut.valid_drafts([], [D, A]) == 0 and cut.valid_drafts([], []) == 0
    assert cut.valid_drafts([A], [B, C, A]) == 2
    assert cut.valid_drafts([A, B, C], [A, B]) == 0 and cut.valid_drafts([A, B, C], [D, EOS]) == 2
    assert cut.valid_drafts([A, B, C, D], [99]) == 0  # outside the vocabulary
    with pytest.raises(ValueError, match="only grows"):
        cut.valid_drafts([A], [B])
    refused = DraftGrammar(compiled())
    assert refused.valid_drafts([D], [B]) == 0  # an output the grammar refused: no drafts after it


def _emitted(drafts: list[int], logits_by_position: list[torch.Tensor], seed: int):
    """DRAWS verifications of `drafts` at temperature 1; the tokens each emits."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    matcher = GrammarMatcher(compiled(), [])
    rows = []
    for _ in range(DRAWS):
        rows += _verification_rows(SamplingRow(params, [1], [], None, EOS, matcher), drafts)
    logits = torch.stack(logits_by_position * DRAWS)
    targets = Sampler(device="cpu", seed=seed)(logits, SamplingBatch.build(rows, "cpu")).token_ids
    width = len(drafts) + 1
    return [targets[width * i:width * (i + 1)][:num_accepted(drafts, targets[width * i:width * (i + 1)]) + 1]
            for i in range(DRAWS)]


def _chi2(observed: list[int], logits: torch.Tensor, allowed_ids: list[int]) -> float:
    counts = torch.bincount(torch.tensor(observed), minlength=VOCAB).double()
    assert counts.sum() == counts[allowed_ids].sum(), "a token outside the grammar was emitted"
    expected = torch.softmax(logits.double()[allowed_ids], 0) * len(observed)
    return float(((counts[allowed_ids] - expected) ** 2 / expected).sum())


def test_sampled_verification_keeps_the_masked_distribution():
    """Position 0 allows a, b, c and position 1 (after "c") b, c, d; the logits favour tokens the
    grammar forbids. The first emitted token follows position 0's masked target whatever the
    drafts; the second, after an accepted "c", position 1's."""
    logits0 = torch.tensor([3.0, 0.2, 1.0, 0.6, 4.0])
    logits1 = torch.tensor([3.0, 5.0, 0.1, 1.2, 0.7])
    logits2 = torch.zeros(VOCAB)
    emitted = _emitted([C, D], [logits0, logits1, logits2], seed=3)
    first = [e[0] for e in emitted]
    second = [e[1] for e in emitted if len(e) > 1]
    assert _chi2(first, logits0, [A, B, C]) < CHI2_CRITICAL
    assert _chi2(second, logits1, [B, C, D]) < CHI2_CRITICAL
    assert DRAWS / 10 < len(second) < DRAWS  # "c" (p ~ 0.30 under the mask) is accepted now and then


def test_a_refused_draft_is_never_accepted():
    logits0 = torch.tensor([3.0, 0.2, 1.0, 0.6, 9.0])  # "d" would win without the mask
    emitted = _emitted([D, B], [logits0, torch.zeros(VOCAB), torch.zeros(VOCAB)], seed=5)
    assert all(len(e) == 1 for e in emitted)
    assert _chi2([e[0] for e in emitted], logits0, [A, B, C]) < CHI2_CRITICAL


def test_an_eos_draft_where_the_grammar_is_complete_is_allowed_and_only_eos_follows():
    masks, valid = GrammarMatcher(compiled("[ab]"), []).draft_masks([A, EOS, B])
    assert valid == 2
    assert [allowed(m) for m in masks] == [{A, B}, {EOS}, {EOS}, {EOS}]  # never an empty row
