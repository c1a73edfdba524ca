"""POST /v1/completions: one or more prompts (text or token ids), n samples each.

Choice `i * n + j` is sample j of prompt i. Streamed, each chunk carries one choice's new text
(and its logprobs); a chunk is held back while its tokens' text is (a partial character, or a
possible stop string).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from blockserve.engine.outputs import RequestOutput
from blockserve.server.async_engine import AsyncEngine, Prompt, RequestStream
from blockserve.server.auth import cache_salt
from blockserve.server.config import ServerConfig
from blockserve.server.generation import add_all, check_common, include_usage, sampling_params, usage
from blockserve.server.http_errors import APIError
from blockserve.server.protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from blockserve.server.streaming import DONE, Sent, collect, error_event, event, merge, sse_response


async def create_completion(engine: AsyncEngine, config: ServerConfig, body: CompletionRequest, request: Request):
    """A Completion, an SSE stream of them, or 499 if the client went away first."""
    check_common(body, config)
    if body.best_of is not None and body.best_of != body.n:  # echo, suffix, logit_bias: refused in protocol.py
        raise APIError(400, "best_of other than n is not supported; remove it or set it equal to n", param="best_of",
                       code="unsupported_parameter")
    prompts = _prompt_list(body.prompt)
    params = sampling_params(body, body.max_tokens, body.logprobs)
    salt = cache_salt(config, request, body.cache_salt)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = await add_all(engine, request_id, prompts, params, salt)
    header = dict(id=request_id, created=created, model=config.served_model_name)
    if body.stream:
        return sse_response(_events(header, streams, params.n, include_usage(body)), streams)
    finals = await collect(streams, request)
    if finals is None:
        return Response(status_code=499)
    choices = [
        CompletionChoice(index=i * params.n + c.index, text=c.text, finish_reason=c.finish_reason,
                         stop_reason=c.stop_reason,
                         logprobs=CompletionLogprobs.build(c.logprobs, c.token_ids, 0)
                         if body.logprobs is not None else None)
        for i, final in enumerate(finals) for c in final.outputs
    ]
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


async def _events(header: dict, streams: list[RequestStream], n: int, with_usage: bool) -> AsyncIterator[str]:
    sent: dict[int, Sent] = {}
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, output in merge(streams):
            finals[i] = output
            for c in output.outputs:
                index = i * n + c.index
                delta = sent.setdefault(index, Sent()).advance(c)
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
