"""POST /v1/chat/completions: messages through the model's chat template, n samples.

The template runs on the engine thread (the tokenizer is that thread's). Streamed, each choice
opens with a chunk `{"role": "assistant", "content": ""}`, then carries its new text. With
tools, a template with a Hermes-style tools section renders them and the model's `<tool_call>`
blocks are read back (tools/hermes.py); any other gets a grammar-enforced envelope (tools/envelope.py).
Either is answered as `tool_calls` (streamed as OpenAI's tool-call deltas) or as plain content.
`chat_template_kwargs` are the template's variables. With `--reasoning-parser`, the thinking
block is split off into `reasoning_content` (reasoning.py) before the text is read for tool calls;
a grammar-constrained output (structured outputs, forced tool calls, the JSON envelope) has no
room for a block, so it is not parsed. A template that speaks harmony (GPT-OSS) renders the tools
itself and its output keeps its special tokens, read by channel (harmony.py) into
`reasoning_content`, `content` and `tool_calls`, whatever `--reasoning-parser` says; a forced tool
choice there takes the envelope.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from blockserve.engine.llm_engine import LLMEngine
from blockserve.engine.template_kwargs import template_kwargs
from blockserve.server.engine_bridge.async_engine import AsyncEngine, RequestStream
from blockserve.server.http.auth import cache_salt
from blockserve.server.config import ServerConfig
from blockserve.server.openai_api.generation import add_all, check_common, include_usage, sampling_params, usage
from blockserve.server.http.errors import APIError
from blockserve.server.tools.hermes import (
    HermesStream, hermes_grammar, hermes_history, hermes_prompt, parse_hermes, renders_hermes_tools,
)
from blockserve.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatLogprobs, ChatMessage, Delta, Usage,
)
from blockserve.server.openai_api.harmony import HarmonyStream, parse_harmony, speaks_harmony, turn_end_ids
from blockserve.server.openai_api.reasoning import REASONING_FORMATS, ReasoningFormat, ReasoningStream
from blockserve.server.openai_api.streaming import DONE, Sent, collect, error_event, event, sse_response
from blockserve.server.openai_api.structured import compiled
from blockserve.server.tools.envelope import EnvelopeStream, merge_deltas, parse_envelope, render_history, tool_setup


async def create_chat_completion(engine: AsyncEngine, config: ServerConfig, body: ChatCompletionRequest,
                                 request: Request):
    """A ChatCompletion, an SSE stream of chunks, or 499 if the client went away first."""
    check_common(body, config)  # tools, ...: refused in protocol.py unless neutral
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs", code="invalid_value")
    tools = tool_setup(body)
    variables = template_kwargs(body.chat_template_kwargs)
    tokenizer = engine.engine.tokenizer
    harmony = speaks_harmony(tokenizer) and (tools is None or not (tools.required or tools.named))
    native = not harmony and renders_hermes_tools(tokenizer)
    if body.max_tokens is not None and body.max_tokens >= engine.max_model_len:  # even when max_completion_tokens wins
        raise APIError(400, f"max_tokens ({body.max_tokens}) is not under this model's length "
                            f"({engine.max_model_len} tokens)", param="max_tokens", code="context_length_exceeded")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    bounds = engine.engine.grammars.limits.json_bounds
    constraint = None if tools is None or harmony else hermes_grammar(tools, bounds) if native \
        else tools.structured_outputs()
    if constraint is not None:  # the tool calls' grammar
        params = dataclasses.replace(params, structured_outputs=constraint)
    harmony = harmony and params.structured_outputs is None  # a grammar's output has no channels
    if harmony:  # the reader needs the special tokens; a call ends the turn as a return does
        params = dataclasses.replace(params, skip_special_tokens=False,
                                     stop_token_ids=params.stop_token_ids + turn_end_ids(tokenizer))
    thinking = REASONING_FORMATS.get(config.reasoning_parser) \
        if config.reasoning_parser is not None and params.structured_outputs is None and not harmony else None
    params = await compiled(engine, params, body, "tools" if tools is not None else None)  # off the engine thread
    salt = cache_salt(config, request, body.cache_salt)
    if native or harmony:
        prompt = hermes_prompt(engine.engine, hermes_history(chat_messages(body.messages)), tools,
                               body.add_generation_prompt, variables)
    else:
        prompt = _chat_prompt(engine.engine, render_history(chat_messages(body.messages), tools),
                              body.add_generation_prompt, variables)
    parse, reader = _tool_output(tools, native)
    if harmony:
        parse, reader = functools.partial(parse_harmony, setup=tools), functools.partial(HarmonyStream, tools)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = await add_all(engine, request_id, [prompt], params, salt, body.request_timeout)
    header = dict(id=request_id, created=created, model=config.served_model_name)
    top = body.top_logprobs or 0
    if body.stream:
        return sse_response(_events(header, streams[0], params.n, include_usage(body), body.logprobs, top,
                                    reader, thinking, harmony), streams)
    finals = await collect(streams, request)
    if finals is None:
        return Response(status_code=499)
    choices = [
        ChatChoice(index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
                   logprobs=ChatLogprobs.build(c.logprobs, c.token_ids, top) if body.logprobs else None)
        for c in finals[0].outputs
        for message, finish_reason in [_harmony_message(c, parse) if harmony else _assistant_message(c, parse, thinking)]
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
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls  # tools.render_history renders them
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return messages


def _tool_output(tools, native: bool) -> tuple[Callable | None, Callable | None]:
    """How the output is read with tools: (parse the whole text, a new streaming reader), or
    (None, None) when it is plain text."""
    if tools is None:
        return None, None
    if native:
        return functools.partial(parse_hermes, setup=tools), functools.partial(HermesStream, tools)
    return parse_envelope, EnvelopeStream


def _assistant_message(c, parse: Callable | None,
                       thinking: ReasoningFormat | None = None) -> tuple[AssistantMessage, str | None]:
    """A choice's message and finish reason: with a reasoning format, its thinking block split
    off; with tools, the rest read as calls and content."""
    reasoning, text = thinking.split(c.text) if thinking is not None else (None, c.text)
    if parse is None:
        return AssistantMessage(content=text, reasoning_content=reasoning), c.finish_reason
    content, calls = parse(text or "") if c.finish_reason == "stop" else (text, None)
    return (AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls),
            "tool_calls" if calls else c.finish_reason)


def _harmony_message(c, parse: Callable) -> tuple[AssistantMessage, str | None]:
    """A choice's message read by channel (harmony.py); its calls, even those cut off, as calls."""
    reasoning, content, calls = parse(c.text)
    return (AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls),
            "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason)


def _chat_prompt(engine: LLMEngine, messages: list[dict], add_generation_prompt: bool, variables: dict):
    """The prompt as a callable the engine thread runs: the tokenizer is the engine thread's."""

    return lambda: engine.apply_chat_template(messages, add_generation_prompt, variables)


async def _events(header: dict, stream: RequestStream, n: int, with_usage: bool, logprobs: bool,
                  top: int, new_reader: Callable | None = None,
                  thinking: ReasoningFormat | None = None, harmony: bool = False) -> AsyncIterator[str]:
    """The chunks; with `harmony`, `new_reader` makes HarmonyStreams, which give the reasoning too."""
    def chunk(choices: list[ChatChunkChoice], usage_block: Usage | None = None) -> str:
        return event(ChatCompletionChunk(**header, choices=choices, usage=usage_block))

    sent: dict[int, Sent] = {}
    readers: dict = {}  # with tools: each choice's output, read as it grows
    thinkers: dict[int, ReasoningStream] = {}  # with a reasoning format: each choice's, likewise
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
                calls, finish_reason, reasoning = None, c.finish_reason, ""
                if harmony:
                    reader = readers.get(c.index)
                    if reader is None:
                        reader = readers[c.index] = new_reader()
                    reasoning, text, calls = reader.feed(text)
                    if c.finished:
                        more_reasoning, more_text, more = reader.finish()
                        reasoning, text, calls = reasoning + more_reasoning, text + more_text, merge_deltas(calls + more)
                    if reader.called and finish_reason == "stop":
                        finish_reason = "tool_calls"
                if thinking is not None:
                    thinker = thinkers.setdefault(c.index, ReasoningStream(thinking))
                    reasoning, text = thinker.feed(text)
                    if c.finished:
                        more_reasoning, more_text = thinker.finish()
                        reasoning, text = reasoning + more_reasoning, text + more_text
                if new_reader is not None and not harmony:
                    reader = readers.get(c.index)
                    if reader is None:
                        reader = readers[c.index] = new_reader()
                    text, calls = reader.feed(text)
                    if c.finished:  # what the reader held back
                        rest, more = reader.finish()
                        text, calls = text + rest, merge_deltas(calls + more)
                    if reader.called and finish_reason == "stop":
                        finish_reason = "tool_calls"
                if reasoning and (text or calls or c.finished):  # the thought goes out before the answer
                    yield chunk([ChatChunkChoice(index=c.index, delta=Delta(reasoning_content=reasoning))])
                    reasoning = ""
                if not reasoning and not text and not calls and not c.finished and not (logprobs and lps):
                    continue
                yield chunk([ChatChunkChoice(
                    index=c.index, delta=Delta(reasoning_content=reasoning) if reasoning
                    else Delta(content=(text or None) if calls else text, tool_calls=calls or None)
                    if text or calls or not c.finished else Delta(),
                    finish_reason=finish_reason, stop_reason=c.stop_reason,
                    logprobs=ChatLogprobs.build(lps, ids, top) if logprobs and lps is not None else None)])
        if with_usage and final is not None:
            yield chunk([], usage([final]))
    except Exception as e:
        yield error_event(e)
    finally:
        stream.close()
    yield DONE
