"""POST /v1/chat/completions: messages through the model's chat template, n samples.

The template runs on the engine thread (the tokenizer is that thread's). Streamed, each choice
opens with a chunk `{"role": "assistant", "content": ""}`, then carries its new text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from blockserve.engine.llm_engine import LLMEngine
from blockserve.server.async_engine import AsyncEngine, RequestStream
from blockserve.server.auth import cache_salt
from blockserve.server.config import ServerConfig
from blockserve.server.generation import add_all, check_common, include_usage, sampling_params, usage
from blockserve.server.http_errors import APIError
from blockserve.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatLogprobs, ChatMessage, Delta, Usage,
)
from blockserve.server.streaming import DONE, Sent, collect, error_event, event, sse_response


async def create_chat_completion(engine: AsyncEngine, config: ServerConfig, body: ChatCompletionRequest,
                                 request: Request):
    """A ChatCompletion, an SSE stream of chunks, or 499 if the client went away first."""
    check_common(body, config)  # tools, response_format, ...: refused in protocol.py unless neutral
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs", code="invalid_value")
    messages = chat_messages(body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    salt = cache_salt(config, request, body.cache_salt)
    prompt = _chat_prompt(engine.engine, messages, body.add_generation_prompt)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = await add_all(engine, request_id, [prompt], params, salt)
    header = dict(id=request_id, created=created, model=config.served_model_name)
    top = body.top_logprobs or 0
    if body.stream:
        return sse_response(_events(header, streams[0], params.n, include_usage(body), body.logprobs, top), streams)
    finals = await collect(streams, request)
    if finals is None:
        return Response(status_code=499)
    choices = [
        ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                   stop_reason=c.stop_reason,
                   logprobs=ChatLogprobs.build(c.logprobs, c.token_ids, top) if body.logprobs else None)
        for c in finals[0].outputs
    ]
    return ChatCompletion(**header, choices=choices, usage=usage(finals))


def chat_messages(body_messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them: text only, `developer` read as `system`."""
    messages = []
    for i, message in enumerate(body_messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                                   param="messages", code="unsupported_content")
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": content or ""}
        if message.name:
            entry["name"] = message.name
        messages.append(entry)
    return messages


def _chat_prompt(engine: LLMEngine, messages: list[dict], add_generation_prompt: bool):
    """The prompt as a callable the engine thread runs: the tokenizer is the engine thread's."""

    return lambda: engine.apply_chat_template(messages, add_generation_prompt)


async def _events(header: dict, stream: RequestStream, n: int, with_usage: bool, logprobs: bool,
                  top: int) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage_block: Usage | None = None) -> str:
        return event(ChatCompletionChunk(**header, choices=choices, usage=usage_block))

    sent: dict[int, Sent] = {}
    final = None
    try:
        for index in range(n):
            yield chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
        async for final in stream:
            for c in final.outputs:
                delta = sent.setdefault(c.index, Sent()).advance(c)
                if delta is None:
                    continue
                text, ids, lps, _ = delta
                if not text and not c.finished and not (logprobs and lps):
                    continue
                yield chunk([ChatChunkChoice(
                    index=c.index, delta=Delta(content=text) if text or not c.finished else Delta(),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=ChatLogprobs.build(lps, ids, top) if logprobs and lps is not None else None)])
        if with_usage and final is not None:
            yield chunk([], usage([final]))
    except Exception as e:
        yield error_event(e)
    finally:
        stream.close()
    yield DONE
