"""The needle-in-a-haystack check (blockserve/bench/needle.py) on a character tokenizer: each prompt
is exactly its context, the needle sits at its depth and the question ends it, and an answer counts
only when it starts with the passphrase."""

from __future__ import annotations

import pytest

from blockserve.bench.needle import NEEDLE, QUESTION, needle_cases, retrieved


class Characters:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) for ch in text]


def text(ids) -> str:
    return "".join(map(chr, ids))


def test_each_prompt_is_its_context_with_the_needle_at_its_depth():
    cases = needle_cases(Characters(), [300, 1000], [0.0, 0.5, 1.0], seed=1)
    assert [(c.context, c.depth) for c in cases] == [(n, d) for n in (300, 1000) for d in (0.0, 0.5, 1.0)]
    assert len({c.passphrase for c in cases}) == len(cases)
    for case in cases:
        prompt = text(case.prompt_token_ids)
        needle = NEEDLE.format(case.passphrase, case.passphrase)
        assert len(prompt) == case.context and prompt.endswith(QUESTION) and prompt.count(case.passphrase) == 2
        room = case.context - len(needle) - len(QUESTION)
        assert prompt.index(needle) == round(case.depth * room)
    assert needle_cases(Characters(), [300, 1000], [0.0, 0.5, 1.0], seed=1) == cases  # seeded


def test_a_context_too_short_for_the_needle_is_refused():
    with pytest.raises(ValueError, match="needs between"):
        needle_cases(Characters(), [40], [0.5])


@pytest.mark.parametrize("answer,found", [(" 60494.\n", True), ("60494", True), (" 6 0 4 9 4.", True),
                                          (" 60495.", False), (" the 60494", False), (" 6049", False)])
def test_an_answer_counts_only_when_it_starts_with_the_passphrase(answer, found):
    assert retrieved(answer, "60494") is found
