"""POST /v1/completions: one or more prompts (text or token ids), n samples each.

Choice `i * n + j` is sample j of prompt i. Streamed, each chunk carries one choice's new text
(and its logprobs); a chunk is held back while its tokens' text is (a partial character, or a
possible stop string). `echo` (echo.py): the prompt first, streamed as each choice's first chunk;
`best_of` (best_of.py): the best n of best_of candidates. `suffix` is refused (protocol.py).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from blockserve.engine.outputs import RequestOutput
from blockserve.server.engine_bridge.async_engine import AsyncEngine, Prompt, RequestStream
from blockserve.server.http.auth import cache_salt
from blockserve.server.openai_api.best_of import best, candidates
from blockserve.server.config import ServerConfig
from blockserve.server.openai_api.echo import EchoedPrompt, echoed_prompt, joined, without_generation
from blockserve.server.openai_api.generation import add_all, check_common, include_usage, sampling_params, usage
from blockserve.server.http.errors import APIError
from blockserve.server.protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from blockserve.server.openai_api.streaming import DONE, Sent, collect, error_event, event, merge, sse_response
from blockserve.server.openai_api.structured import compiled


async def create_completion(engine: AsyncEngine, config: ServerConfig, body: CompletionRequest, request: Request):
    """A Completion, an SSE stream of them, or 499 if the client went away first."""
    check_common(body, config)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1; 0 (score the prompt, generate nothing) needs echo: true",
                       param="max_tokens", code="invalid_value")
    n = candidates(body, config)  # best_of, or n
    prompts = _prompt_list(body.prompt)
    ranking = n > body.n and body.logprobs is None  # best_of ranks by logprobs, asked for or not
    params = sampling_params(body, 1 if body.max_tokens == 0 else body.max_tokens, 0 if ranking else body.logprobs)
    params = dataclasses.replace(params, n=n,
                                 prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None)
    params = await compiled(engine, params, body)  # the grammar, off the engine thread
    salt = cache_salt(config, request, body.cache_salt)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = await add_all(engine, request_id, prompts, params, salt, body.request_timeout)
    header = dict(id=request_id, created=created, model=config.served_model_name)
    if body.stream:
        echo = _Echo(engine, prompts, body.logprobs is not None) if body.echo else None
        return sse_response(_events(header, streams, params.n, include_usage(body), echo, body.max_tokens == 0),
                            streams)
    finals = await collect(streams, request)
    if finals is None:
        return Response(status_code=499)
    if body.max_tokens == 0:
        finals = [dataclasses.replace(f, outputs=[without_generation(c) for c in f.outputs]) for f in finals]
    choices = []
    for i, final in enumerate(finals):
        echo = await echoed_prompt(engine, prompts[i], final, body.logprobs is not None) if body.echo else None
        outputs = best(final.outputs, body.n, body.logprobs is not None) if n > body.n else final.outputs
        for c in outputs:
            logprobs = (CompletionLogprobs.build(c.logprobs, c.token_ids, len(echo.text) if echo else 0)
                        if body.logprobs is not None else None)
            choices.append(CompletionChoice(
                index=i * body.n + c.index, text=echo.text + c.text if echo else c.text, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, logprobs=joined(echo, logprobs) if echo else logprobs))
    return Completion(**header, choices=choices, usage=usage(finals))


def _prompt_list(prompt) -> list[Prompt]:
    """`prompt` as a list of prompts (text, or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


class _Echo:
    """What a stream with `echo` needs to send each prompt first (echo.py), and each prompt's echo once built."""

    def __init__(self, engine: AsyncEngine, prompts: list[Prompt], with_logprobs: bool):
        self.engine, self.prompts, self.with_logprobs = engine, prompts, with_logprobs
        self.built: dict[int, EchoedPrompt] = {}

    async def of(self, i: int, output: RequestOutput) -> EchoedPrompt:
        if i not in self.built:
            self.built[i] = await echoed_prompt(self.engine, self.prompts[i], output, self.with_logprobs)
        return self.built[i]


async def _events(header: dict, streams: list[RequestStream], n: int, with_usage: bool, echo: _Echo | None = None,
                  no_generation: bool = False) -> AsyncIterator[str]:
    sent: dict[int, Sent] = {}
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, output in merge(streams):
            if no_generation:  # max_tokens 0 with echo: the engine's one token is dropped
                output = dataclasses.replace(output, outputs=[without_generation(c) for c in output.outputs])
            finals[i] = output
            for c in output.outputs:
                index = i * n + c.index
                if index not in sent:
                    sent[index] = Sent()
                    if echo is not None:  # the choice's first chunk is its prompt
                        prompt = await echo.of(i, output)
                        sent[index].offset = len(prompt.text)
                        yield event(Completion(**header, choices=[
                            CompletionChoice(index=index, text=prompt.text, logprobs=prompt.logprobs)]))
                delta = sent[index].advance(c)
                if delta is None:
                    continue
                text, ids, lps, offset = delta
                if not text and not c.finished and lps is None:
                    continue  # tokens whose text is held back (a partial character or stop string)
                choice = CompletionChoice(
                    index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=CompletionLogprobs.build(lps, ids, offset) if lps is not None else None)
                yield event(Completion(**header, choices=[choice]))
        if with_usage:
            yield event(Completion(**header, choices=[], usage=usage(finals)))
    except Exception as e:
        yield error_event(e)
    finally:
        for stream in streams:
            stream.close()
    yield DONE
