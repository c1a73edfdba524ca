"""A request's constraints: chat's `response_format`, vLLM's `structured_outputs` (both
endpoints) and `logit_bias`, as SamplingParams fields; the grammar is compiled off the event
loop and off the engine thread, so a slow compile delays only its own request.

    response_format {type: json_schema, json_schema: {schema}} ─┐
    response_format {type: json_object}                         ├─► StructuredOutputsParams ─► compile (thread)
    structured_outputs {json | regex | choice | grammar | ...}  ─┘     400 with llguidance's reason if it cannot
"""

from __future__ import annotations

import asyncio
import re

from blockserve.errors import InvalidRequest
from blockserve.sampling_params import SamplingParams, StructuredOutputsParams
from blockserve.server.engine_bridge.async_engine import AsyncEngine
from blockserve.server.http.errors import APIError
from blockserve.server.protocol import ChatCompletionRequest, CompletionRequest

_TOKEN_ID = re.compile(r"0|[1-9][0-9]*", re.ASCII)


def structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The body's constraint (None: unconstrained); 400 naming the field when it is malformed or
    when both response_format and structured_outputs constrain the output."""
    response_format = getattr(body, "response_format", None)
    constrained_format = response_format is not None and response_format.type != "text"
    if constrained_format and body.structured_outputs is not None:
        raise APIError(400, "give either response_format or structured_outputs, not both",
                       param="structured_outputs", code="invalid_value")
    try:
        if constrained_format:
            if response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if response_format.json_schema is None:
                raise ValueError("response_format of type json_schema needs json_schema: {name, schema}")
            schema = response_format.json_schema.schema_
            return StructuredOutputsParams(json={} if schema is None else schema)
        request = body.structured_outputs
        if request is None:
            return None
        return StructuredOutputsParams(json=request.json_, regex=request.regex, choice=request.choice,
                                       grammar=request.grammar, json_object=request.json_object or None)
    except ValueError as e:
        raise APIError(400, str(e), param=_field(body), code="invalid_value") from None


def logit_bias(body: CompletionRequest | ChatCompletionRequest) -> dict[int, float]:
    """The body's logit_bias with integer token ids ({} when absent); 400 for a key that is not one
    written in decimal (ranges are SamplingParams' to check, the vocabulary the engine's)."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):  # as written: no sign, spaces, underscores or leading zeros
            raise APIError(400, f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                           param="logit_bias", code="invalid_value")
        bias[int(key)] = value
    return bias


async def compiled(engine: AsyncEngine, params: SamplingParams, body: CompletionRequest | ChatCompletionRequest,
                   field: str | None = None) -> SamplingParams:
    """`params` with its grammar compiled (and logit_bias checked against the vocabulary) on a
    worker thread; a 400 with the engine's reason when it cannot be, naming `field` (default: the
    body's response_format or structured_outputs)."""
    if params.structured_outputs is None and not params.logit_bias:
        return params
    try:
        return await asyncio.to_thread(engine.engine.prepare_params, params)
    except InvalidRequest as e:
        param = e.param if e.param == "logit_bias" else field or _field(body)
        message = str(e)
        if param == "response_format":
            message = message.replace("structured_outputs.json", "response_format's schema", 1)
        raise APIError(400, message, param=param, code=e.code) from None


def _field(body) -> str:
    response_format = getattr(body, "response_format", None)
    return "response_format" if response_format is not None and response_format.type != "text" \
        else "structured_outputs"
