"""SpeculativeConfig's refusals, the n-gram proposer, the acceptance rule and the speculator's books."""

from __future__ import annotations

import pytest

from blockserve.spec_decode.acceptance import num_accepted
from blockserve.spec_decode.config import SpeculativeConfig
from blockserve.spec_decode.ngram import NgramProposer
from blockserve.spec_decode.speculator import FIRST_BACKOFF_STEPS, Speculator


def test_the_json_shape_parses():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
                                     '"prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 2, 4)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, field", [
    ('{"method": "eagle"}', "method"), ('{"method": "bogus"}', "method"), ('{"num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "model": "x"}', "model"), ('{"method": "ngram", "k": 2}', "k"), ("{not json", "JSON"),
])
def test_bad_configs_are_refused_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)


def test_ngram_proposes_what_followed_the_latest_match_longest_first():
    proposer = NgramProposer(1, 3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert proposer.propose("r", tokens, 3) == [4, 5, 7]  # "7 2 3" unseen; "2 3" last seen at 6..7
    tokens.append(4)
    assert proposer.propose("r", tokens, 2) == [5, 7]  # "2 3 4" seen at 6..8
    assert proposer.propose("s", [5, 6], 4) == []  # another request, no match
    assert proposer.num_requests == 2
    proposer.forget("r")
    assert proposer.num_requests == 1


def test_acceptance_keeps_the_agreeing_prefix():
    assert num_accepted([4, 5, 6], [4, 5, 9, 1]) == 2
    assert num_accepted([4, 5], [4, 5, 8]) == 2
    assert num_accepted([4], [3, 4]) == 0
    with pytest.raises(ValueError):
        num_accepted([4], [4])


def test_a_request_with_low_acceptance_pauses_then_tries_again():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1))
    tokens = [1, 2, 1, 2, 1]
    assert speculator.propose("r", tokens, 4, 1)
    for _ in range(4):
        speculator.record("r", 4, 0)  # 16 drafts, none accepted
    assert all(speculator.propose("r", tokens, 4, 1) == [] for _ in range(FIRST_BACKOFF_STEPS))
    assert speculator.propose("r", tokens, 4, 1)
    stats = speculator.stats()
    assert stats.num_draft_tokens == 16 and stats.num_accepted_tokens == 0 and stats.num_skipped == FIRST_BACKOFF_STEPS
    speculator.record("r", 4, 3)
    assert speculator.stats().per_position_acceptance == (0.2, 0.2, 0.2, 0.0)
    assert speculator.stats().mean_accepted_length == 1 + 3 / 5
    speculator.forget("r")
    assert speculator.num_requests == 0


def test_large_batches_do_not_speculate():
    speculator = Speculator(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=1, disable_by_batch_size=8))
    assert speculator.propose("r", [1, 2, 1], 4, 8) == []
    assert speculator.propose("r", [1, 2, 1], 4, 7) == [2, 1]
