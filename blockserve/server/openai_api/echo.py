"""`echo` on /v1/completions: each choice's text starts with its prompt's, and with `logprobs`
its logprobs start with the prompt tokens' (what lm-eval's loglikelihood tasks read).

    choice.text      = prompt text + completion text
    logprobs.tokens  = [p0, p1, ..., pk,  c0, c1, ...]
    token_logprobs   = [null, lp(p1), ..., lp(pk),  lp(c0), ...]    (OpenAI's and vLLM's shape:
    top_logprobs     = [null, {...}, ...,           {...}, ...]      nothing precedes p0)
    text_offset      = offsets in choice.text (the prompt's from 0, the completion's from len(prompt text))

The prompt entries come from the engine's prompt logprobs (SamplingParams.prompt_logprobs = the
body's `logprobs`), so such requests compute their whole prompt (no prefix-cache hit: see
worker/prompt_logprobs.py). Echo without logprobs needs no logits and uses the cache as usual.
`max_tokens: 0` with echo (a prompt scored, nothing generated) runs the engine for one token and
drops it, as vLLM does: the choice is the prompt alone, finish_reason "length", no completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockserve.engine.outputs import CompletionOutput, RequestOutput
from blockserve.server.engine_bridge.async_engine import AsyncEngine, Prompt
from blockserve.server.protocol import CompletionLogprobs


@dataclass(frozen=True)
class EchoedPrompt:
    text: str
    logprobs: CompletionLogprobs | None  # None unless the body asked for logprobs


async def echoed_prompt(engine: AsyncEngine, prompt: Prompt, output: RequestOutput,
                        with_logprobs: bool) -> EchoedPrompt:
    """The prompt's text (a token-id prompt is detokenized, on the engine thread: the tokenizer
    is its) and, if asked, its entries in the legacy logprobs shape."""
    llm = engine.engine
    ids = output.prompt_token_ids
    text, first = await engine.call(lambda: (prompt if isinstance(prompt, str) else llm.detokenize(ids),
                                             llm.detokenize(ids[:1]) if with_logprobs else ""))
    if not with_logprobs:
        return EchoedPrompt(text, None)
    entries = output.prompt_logprobs
    if entries is None or len(entries) != len(ids):
        raise RuntimeError(f"request {output.request_id}: echo with logprobs got no prompt logprobs from the engine")
    head = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    return EchoedPrompt(text, concatenated(head, CompletionLogprobs.build(entries[1:], ids[1:], len(first))))


def joined(echo: EchoedPrompt, completion: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """The prompt's entries followed by the completion's (None: the completion part is dropped)."""
    if echo.logprobs is None:
        return completion
    if completion is None:
        return echo.logprobs
    return concatenated(echo.logprobs, completion)


def concatenated(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def without_generation(c: CompletionOutput) -> CompletionOutput:
    """`max_tokens: 0`: the choice with its one (engine-side) token dropped."""
    return CompletionOutput(c.index, "", [], "length", None, [] if c.logprobs is not None else None)
