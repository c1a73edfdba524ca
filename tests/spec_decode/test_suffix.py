"""Suffix decoding: the most frequent continuation of the longest match, from the request's own
tokens or the outputs of finished requests, with the cross-request trie bounded."""

from __future__ import annotations

from blockserve.spec_decode.config import SpeculativeConfig
from blockserve.spec_decode.speculator import Speculator, make_proposer
from blockserve.spec_decode.suffix import SuffixProposer, SuffixTrie


def proposer(max_cached_requests: int = 2, min_token_prob: float = 0.1) -> SuffixProposer:
    return SuffixProposer(max_depth=6, max_cached_requests=max_cached_requests, max_spec_factor=2.0,
                          min_token_prob=min_token_prob)


def test_the_most_frequent_continuation_of_the_longest_match_is_proposed():
    p = proposer()
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 9, 1, 2]
    # "1 2" went on with "3 4" twice and "5" once; the longer match "9 1 2" is unseen.
    assert p.propose("r", tokens, 3) == [3, 4, 1]
    tokens += [3, 4]
    assert p.propose("r", tokens, 4) == [1, 2, 3, 4]  # "2 3 4" was followed by "1 2" twice, then "3 4"
    assert p.propose("r", [7, 8], 4) == []  # the same request id, as it passes its tokens: no match
    p.forget("r")
    assert p.num_requests == 0


def test_rare_continuations_and_short_matches_stop_the_draft():
    strict = proposer(min_token_prob=0.6)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # "1 2" went on with 3, 4, 5: each a third
    assert strict.propose("r", tokens, 4) == []
    loose = SuffixProposer(max_depth=6, max_cached_requests=0, max_spec_factor=1.0, min_token_prob=0.0)
    assert len(loose.propose("r", [1, 2, 3, 4, 9, 3], 4)) == 1  # a one-token match drafts one token


def test_finished_outputs_are_shared_and_the_oldest_are_evicted():
    p = proposer(max_cached_requests=2)
    for rid, output in (("a", [10, 11, 12, 13]), ("b", [20, 21, 22, 23]), ("c", [30, 31, 32, 33])):
        tokens = [1, 2]  # the prompt; the first proposal sees it and the first output token
        tokens.append(output[0])
        p.propose(rid, tokens, 4)
        tokens += output[1:]  # the scheduler's list grows with the request
        p.forget(rid)
    assert p.num_requests == 0 and p.num_cached_requests == 2
    assert p.propose("d", [7, 20, 21], 2) == [22, 23]  # from b's output
    assert p.propose("e", [7, 10, 11], 2) == []  # a's output was evicted, its counts taken out
    p.forget("d"), p.forget("e")
    assert list(p._cached) == ["d", "e"]
    nodes = p.cross.num_nodes
    assert nodes > 0
    kept = SuffixTrie(6)
    for output in p._cached.values():
        kept.add(output)
    assert kept.num_nodes == nodes  # exactly the cached outputs' strings: nothing of the evicted ones remains


def test_the_method_builds_its_proposer():
    config = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 4, '
                                     '"suffix_decoding_max_tree_depth": 8, "suffix_decoding_max_cached_requests": 0}')
    p = make_proposer(config)
    assert isinstance(p, SuffixProposer) and p.max_depth == 8 and p.max_cached_requests == 0


def test_a_reply_joins_the_cross_request_store_whole_while_the_cost_rule_declines_drafts():
    """Until the plain step is measured the cost rule declines every draft; the proposer still follows
    the request from its first step, so the reply it stores starts at the reply's first token."""
    config = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 4, '
                                     '"suffix_decoding_max_cached_requests": 4}')
    speculator = Speculator(config)
    tokens = [1, 2]  # the prompt
    for token in (10, 11, 12, 13):
        tokens.append(token)
        assert speculator.propose("a", tokens, 4, batch_size=1) == []  # declined: nothing measured yet
    speculator.forget("a")
    assert list(speculator.proposer._cached.values()) == [[10, 11, 12, 13]]
