"""What /v1/completions and /v1/chat/completions share: the common checks, a body's
SamplingParams, adding its prompts to the engine (all or none), and the usage block."""

from __future__ import annotations

import asyncio

from blockserve.engine.outputs import RequestOutput
from blockserve.sampling_params import SamplingParams
from blockserve.server.engine_bridge.async_engine import AsyncEngine, Prompt, RequestStream
from blockserve.server.config import ServerConfig
from blockserve.server.http.errors import APIError, from_exception
from blockserve.server.protocol import ChatCompletionRequest, CompletionRequest, PromptTokensDetails, Usage
from blockserve.server.openai_api.structured import logit_bias, structured_outputs

Body = CompletionRequest | ChatCompletionRequest


def check_model(model: str | None, config: ServerConfig) -> None:
    """400 for a model this server does not serve (None: the served one)."""
    if model is not None and model != config.served_model_name:
        raise APIError(400, f"the model {model!r} does not exist; this server serves "
                            f"{config.served_model_name!r}", param="model", code="model_not_found")


def check_common(body: Body, config: ServerConfig) -> None:
    """400 for a model this server does not serve, or stream_options without stream."""
    check_model(body.model, config)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options",
                       code="invalid_value")


def include_usage(body: Body) -> bool:
    """Whether a stream ends with a usage chunk."""
    return bool(body.stream_options and body.stream_options.include_usage)


def sampling_params(body: Body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The body's sampling fields (OpenAI's defaults where unset); 400 if they do not combine."""
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            logit_bias=logit_bias(body),
            structured_outputs=structured_outputs(body),
        )
    except ValueError as e:  # SamplingParams validates its fields together (e.g. min_tokens <= max_tokens)
        raise APIError(400, str(e), code="invalid_value") from None


async def add_all(engine: AsyncEngine, request_id: str, prompts: list[Prompt], params: SamplingParams,
                  salt: str | None, timeout: float | None = None) -> list[RequestStream]:
    """Add every prompt at once (one engine round trip), as `request_id` (one prompt) or
    `request_id-i`, each with deadline `timeout` (None: the server's); if any is rejected, none
    is kept and its error is raised as an APIError."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    results = await asyncio.gather(*(engine.add_request(rid, prompt, params, salt, timeout)
                                     for rid, prompt in zip(ids, prompts)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for stream in results:
            if isinstance(stream, RequestStream):
                stream.close()
        if not isinstance(errors[0], Exception):
            raise errors[0]  # cancelled, or the process is exiting
        error = from_exception(errors[0])
        if len(prompts) > 1:
            error.message = f"prompt {results.index(errors[0])}: {error.message}"
        raise error
    return results


def usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    cached = sum(f.num_cached_tokens for f in finals)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
