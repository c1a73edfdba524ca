"""`best_of` on /v1/completions: `best_of` candidates per prompt are generated and the `n` with
the highest cumulative logprob are returned, best first (OpenAI's legacy API; vLLM's v0).

A candidate's cumulative logprob is the sum of its tokens' logprobs as the sampler reports them
(after penalties, before temperature and the top-k / top-p / min-p filters). The candidates'
logprobs are computed for the ranking even when the body did not ask for any (then they are not
returned). Usage counts every candidate's tokens: they were all generated. best_of must be at
least n and cannot be streamed (which candidates win is known only at the end), as with OpenAI.
"""

from __future__ import annotations

import dataclasses

from blockserve.engine.outputs import CompletionOutput
from blockserve.server.config import ServerConfig
from blockserve.server.http.errors import APIError
from blockserve.server.protocol import CompletionRequest


def candidates(body: CompletionRequest, config: ServerConfig) -> int:
    """How many samples to generate per prompt (best_of, or n); 400 if best_of does not fit."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise APIError(400, f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of",
                       code="invalid_value")
    if body.stream:
        raise APIError(400, "best_of greater than n cannot be streamed: the best candidates are known only at the "
                            "end; set stream to false or best_of equal to n", param="best_of", code="invalid_value")
    if body.best_of > config.max_n:
        raise APIError(400, f"best_of is {body.best_of}, over this server's limit of {config.max_n} samples "
                            f"(--max-n)", param="best_of", code="invalid_value")
    return body.best_of


def cumulative_logprob(c: CompletionOutput) -> float:
    return sum(entry[token].logprob for entry, token in zip(c.logprobs or [], c.token_ids))


def best(outputs: list[CompletionOutput], n: int, keep_logprobs: bool) -> list[CompletionOutput]:
    """The n candidates with the highest cumulative logprob, best first, re-indexed 0..n-1 (ties
    keep the candidates' order); their logprobs dropped unless the body asked for them."""
    ranked = sorted(outputs, key=cumulative_logprob, reverse=True)[:n]
    return [dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None)
            for i, c in enumerate(ranked)]
