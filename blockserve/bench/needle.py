"""Needle-in-a-haystack retrieval: a passphrase hidden at a chosen depth of filler prose, asked for
at the end of the prompt; retrieved when the greedy continuation starts with it.

The filler is CPython's pydoc_data/topics.py (the Python Language Reference, PSF license, shipped
with every CPython), the same prose benchmarks/kv_cache_dtype.py measures KL on. Each case's prompt
is exactly `context` tokens: filler cut to fit, the needle sentence inserted at the token boundary
closest to `depth` (0: the start, 1: just before the question).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NEEDLE = "\nThe secret passphrase is {}. Remember it: the secret passphrase is {}.\n"
QUESTION = "\n\nQuestion: what is the secret passphrase? Answer: the secret passphrase is"


@dataclass(frozen=True)
class NeedleCase:
    """One prompt of `context` tokens holding `passphrase` at `depth` of its filler."""

    context: int
    depth: float
    passphrase: str
    prompt_token_ids: tuple[int, ...]


def filler_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def needle_cases(tokenizer, contexts, depths, seed: int = 0) -> list[NeedleCase]:
    """A case per (context, depth), each with its own 5-digit passphrase (seeded)."""
    rng = random.Random(seed)
    filler = tokenizer.encode(filler_text(), add_special_tokens=False)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    cases = []
    for context in contexts:
        for depth in depths:
            passphrase = str(rng.randrange(10_000, 100_000))
            needle = tokenizer.encode(NEEDLE.format(passphrase, passphrase), add_special_tokens=False)
            room = context - len(needle) - len(question)
            if room <= 0 or room > len(filler):
                raise ValueError(f"a needle prompt of {context} tokens needs between {len(needle) + len(question) + 1} "
                                 f"and {len(filler) + len(needle) + len(question)} tokens")
            at = round(depth * room)
            ids = filler[:at] + needle + filler[at:room] + question
            cases.append(NeedleCase(context, depth, passphrase, tuple(ids)))
    return cases


def retrieved(continuation: str, passphrase: str) -> bool:
    """Whether a continuation answers with the passphrase (its first digits, nothing before them)."""
    digits = "".join(ch for ch in continuation.strip().split(".")[0] if not ch.isspace())
    return digits.startswith(passphrase)


def needle_retrieval(llm, cases: list[NeedleCase], max_tokens: int = 8) -> list[bool]:
    """Each case's greedy continuation on `llm` (an LLM), retrieved or not."""
    from blockserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate([list(c.prompt_token_ids) for c in cases], params, use_tqdm=False)
    return [retrieved(o.outputs[0].text, c.passphrase) for o, c in zip(outputs, cases)]
