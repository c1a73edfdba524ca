"""POST /tokenize and POST /detokenize (vLLM's shapes), on the engine thread (the tokenizer is its).

    /tokenize    {"model"?, "prompt": str, "add_special_tokens": true}
                 or {"model"?, "messages": [...], "add_generation_prompt": true, "chat_template_kwargs"?: {...}}
                 (the chat template, its variables)
                 -> {"tokens": [...], "count": n, "max_model_len": m}
    /detokenize  {"model"?, "tokens": [...]} -> {"prompt": str}

Bodies are validated like the completions' (unknown fields refused); a body with `messages` is a
chat one.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from blockserve.server.engine_bridge.async_engine import AsyncEngine
from blockserve.server.openai_api.chat import chat_messages
from blockserve.server.config import ServerConfig
from blockserve.server.openai_api.generation import check_model
from blockserve.server.http.errors import APIError
from blockserve.server.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest, TokenizeRequest, TokenizeResponse,
)


async def tokenize(engine: AsyncEngine, config: ServerConfig, request: Request) -> TokenizeResponse:
    data = await _json(request)
    chat = isinstance(data, dict) and "messages" in data
    body = _validate(TokenizeChatRequest if chat else TokenizeRequest, data)
    check_model(body.model, config)
    llm = engine.engine
    if chat:
        messages = chat_messages(body.messages)
        ids = await engine.call(lambda: llm.apply_chat_template(messages, body.add_generation_prompt,
                                                                body.chat_template_kwargs))
    else:
        ids = await engine.call(lambda: llm.tokenize(body.prompt, add_special_tokens=body.add_special_tokens))
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)


async def detokenize(engine: AsyncEngine, config: ServerConfig, request: Request) -> DetokenizeResponse:
    body = _validate(DetokenizeRequest, await _json(request))
    check_model(body.model, config)
    llm = engine.engine
    return DetokenizeResponse(prompt=await engine.call(lambda: llm.detokenize(body.tokens)))


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _validate(model: type[BaseModel], data):
    """`data` as `model`; pydantic's complaints are answered like a route's (http/errors.py)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
