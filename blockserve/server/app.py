"""The OpenAI-compatible HTTP API over an AsyncEngine.

    GET  /v1/models               the served model
    POST /v1/completions          text completions; stream: SSE chunks, then `data: [DONE]`
    POST /v1/chat/completions     chat completions, through the model's chat template
    GET  /health                  200 while the engine runs, 503 once it stopped
    GET  /metrics                 Prometheus text format (metrics.py)
    POST /reset_prefix_cache      200, or 409 / 400 with the reason it cannot

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid
parameters (pydantic's too, not FastAPI's 422), an unknown model or a prompt over the model's
length; 401 for a missing or wrong API key; 404 / 405 for unknown routes. A request's error
touches that request only. A client that disconnects has its requests aborted (their blocks
return to the pool before the next step).

Isolation (C6): a request's prefix-cache salt is its `cache_salt`; with
`prefix_cache_isolation="per-key"` it is prefixed by a hash of the caller's bearer token, so
tenants never share cached blocks and cannot name each other's salt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockserve.engine.config import EngineConfig
from blockserve.engine.llm_engine import LLMEngine
from blockserve.engine.outputs import CompletionOutput, RequestOutput
from blockserve.sampling_params import SamplingParams
from blockserve.server.async_engine import AsyncEngine, EngineDeadError, PromptTooLongError, RequestStream
from blockserve.server.metrics import CONTENT_TYPE, Metrics
from blockserve.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatLogprobs, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Delta, ErrorInfo,
    ErrorResponse, ModelCard, ModelList, PromptTokensDetails, TokenLogprob, TopLogprob, Usage,
)

logger = logging.getLogger("blockserve.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what `model=None` loads
ISOLATION_MODES = ("none", "per-key")
_PROTECTED_PREFIXES = ("/v1/", "/reset_prefix_cache")


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = DEFAULT_MODEL_NAME
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    prefix_cache_isolation: str = "none"  # or "per-key"

    def __post_init__(self) -> None:
        if self.prefix_cache_isolation not in ISOLATION_MODES:
            raise ValueError(f"prefix_cache_isolation must be one of {ISOLATION_MODES}, "
                             f"got {self.prefix_cache_isolation!r}")
        if any(not key for key in self.api_keys):
            raise ValueError("API keys must be non-empty strings")


# -- errors ---------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")


def error_body(error: APIError) -> dict:
    return ErrorResponse(error=ErrorInfo(message=error.message, type=error.type, param=error.param,
                                         code=error.code)).model_dump()


def error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def _engine_error(e: Exception) -> APIError:
    """What a request's failure inside the engine means to the client."""
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable")
    if isinstance(e, PromptTooLongError):
        return APIError(400, str(e), code="context_length_exceeded")
    if isinstance(e, ValueError):
        return APIError(400, str(e), code="invalid_value")
    logger.error("request failed: %s: %s", type(e).__name__, e)
    return APIError(500, "internal server error", code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + str(detail) if detail else ''}",
                        code="invalid_json")
    # A union (e.g. `prompt`) reports one error per member; the field's name says enough.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}{more}", param=param, code="invalid_value")


class _AuthMiddleware:
    """401 for protected paths without one of the accepted bearer tokens (plain ASGI, so it
    leaves streaming and disconnect detection alone)."""

    def __init__(self, app, api_keys: Sequence[str]):
        self.app = app
        self.keys = [key.encode() for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and scope["path"].startswith(_PROTECTED_PREFIXES):
            token = _bearer_token(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
            if token is None:
                error = APIError(401, "missing API key: send it as 'Authorization: Bearer <key>'",
                                 code="missing_api_key")
                await error_response(error)(scope, receive, send)
                return
            if not any(hmac.compare_digest(token.encode("latin-1"), key) for key in self.keys):
                await error_response(APIError(401, "invalid API key", code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _bearer_token(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


# -- the app --------------------------------------------------------------------------------------


def create_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and joins it on shutdown."""
    config = config or ServerConfig()
    metrics = Metrics(config.served_model_name, lambda: async_engine.stats)
    async_engine = AsyncEngine(engine, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="blockserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(_AuthMiddleware, api_keys=config.api_keys)
    api = _Handlers(async_engine, config)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, code=codes.get(exc.status_code)))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", code="internal_error"))

    @app.get("/health")
    async def health():
        if not async_engine.is_alive:
            return error_response(APIError(503, "the engine is not running", code="engine_unavailable"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=config.served_model_name, max_model_len=async_engine.max_model_len)])

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if not engine.config.enable_prefix_caching:
            raise APIError(400, "prefix caching is disabled on this server", code="prefix_caching_disabled")
        try:
            ok, reason = await async_engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise _engine_error(e) from None
        if not ok:
            raise APIError(409, f"prefix cache not reset: {reason}", code="blocks_in_use")
        return {"success": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat(body, request)

    return app


class _Handlers:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config

    # -- shared ---------------------------------------------------------------------------------

    def _check_common(self, body) -> None:
        if body.model is not None and body.model != self.config.served_model_name:
            raise APIError(400, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", param="model", code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options",
                           code="invalid_value")

    def _cache_salt(self, request: Request, body_salt: str | None) -> str | None:
        if self.config.prefix_cache_isolation == "none":
            return body_salt
        token = _bearer_token(request.headers.get("authorization", ""))
        tenant = "anonymous" if token is None else hashlib.sha256(token.encode()).hexdigest()
        return tenant if body_salt is None else f"{tenant}:{body_salt}"

    @staticmethod
    def _params(body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
            )
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    async def _add_all(self, request_id: str, prompts: list, params: SamplingParams,
                       salt: str | None) -> list[RequestStream]:
        """Add every prompt at once (one engine round trip); if any is rejected, none is kept."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(*(self.engine.add_request(rid, prompt, params, salt)
                                         for rid, prompt in zip(ids, prompts)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream in results:
                if isinstance(stream, RequestStream):
                    stream.close()
            if not isinstance(errors[0], Exception):
                raise errors[0]
            error = _engine_error(errors[0])
            if len(prompts) > 1:
                error.message = f"prompt {results.index(errors[0])}: {error.message}"
            raise error
        return results

    async def _collect(self, streams: list[RequestStream], request: Request) -> list[RequestOutput] | None:
        """The final output of each stream, or None if the client disconnected first (then
        every stream is aborted)."""

        async def run() -> list[RequestOutput]:
            finals = []
            for stream in streams:
                final = None
                async for final in stream:
                    pass
                finals.append(final)
            return finals

        task = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                if watcher.exception() is None:
                    return None
                logger.warning("cannot watch for a disconnect: %r", watcher.exception())
                await asyncio.wait([task])
            try:
                return task.result()
            except Exception as e:
                raise _engine_error(e) from None
        finally:
            task.cancel()
            watcher.cancel()
            for stream in streams:
                stream.close()

    def _sse(self, events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
        def close_all() -> None:  # also runs when the client disconnected before the body started
            for stream in streams:
                stream.close()

        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(close_all))

    @staticmethod
    def _usage(finals: list[RequestOutput]) -> Usage:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    # -- /v1/completions ------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_common(body)
        for name, unsupported in (("echo", body.echo), ("suffix", body.suffix), ("logit_bias", body.logit_bias)):
            if unsupported:
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_parameter")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of",
                           code="unsupported_parameter")
        prompts = _prompt_list(body.prompt)
        params = self._params(body, body.max_tokens, body.logprobs)
        salt = self._cache_salt(request, body.cache_salt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await self._add_all(request_id, prompts, params, salt)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._sse(self._completion_events(request_id, created, streams, params.n, include_usage),
                             streams)
        finals = await self._collect(streams, request)
        if finals is None:
            return Response(status_code=499)
        choices = [
            CompletionChoice(index=i * params.n + c.index, text=c.text, finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason,
                             logprobs=_completion_logprobs(c.logprobs, c.token_ids, 0)
                             if body.logprobs is not None else None)
            for i, final in enumerate(finals) for c in final.outputs
        ]
        return Completion(id=request_id, created=created, model=self.config.served_model_name, choices=choices,
                          usage=self._usage(finals))

    async def _completion_events(self, request_id: str, created: int, streams: list[RequestStream], n: int,
                                 include_usage: bool) -> AsyncIterator[str]:
        model = self.config.served_model_name
        sent: dict[int, _Sent] = {}
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, output in _merge(streams):
                finals[i] = output
                for c in output.outputs:
                    index = i * n + c.index
                    delta = sent.setdefault(index, _Sent()).advance(c)
                    if delta is None:
                        continue
                    text, ids, lps, offset = delta
                    if not text and not c.finished and lps is None:
                        continue  # tokens whose text is held back (a partial character or stop string)
                    choice = CompletionChoice(
                        index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        logprobs=_completion_logprobs(lps, ids, offset) if lps is not None else None)
                    yield _event(Completion(id=request_id, created=created, model=model, choices=[choice]))
            if include_usage:
                yield _event(Completion(id=request_id, created=created, model=model, choices=[],
                                        usage=self._usage(finals)))
        except Exception as e:
            yield f"data: {_dump(error_body(_engine_error(e)))}\n\n"
        finally:
            for stream in streams:
                stream.close()
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions -------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_common(body)
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools", code="unsupported_parameter")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs", code="invalid_value")
        messages = _chat_messages(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        salt = self._cache_salt(request, body.cache_salt)
        prompt = _chat_prompt(self.engine.engine, messages, body.add_generation_prompt)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await self._add_all(request_id, [prompt], params, salt)
        top = body.top_logprobs or 0
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._sse(self._chat_events(request_id, created, streams[0], params.n, include_usage,
                                               body.logprobs, top), streams)
        finals = await self._collect(streams, request)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        choices = [
            ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                       stop_reason=c.stop_reason,
                       logprobs=_chat_logprobs(c.logprobs, c.token_ids, top) if body.logprobs else None)
            for c in final.outputs
        ]
        return ChatCompletion(id=request_id, created=created, model=self.config.served_model_name, choices=choices,
                              usage=self._usage(finals))

    async def _chat_events(self, request_id: str, created: int, stream: RequestStream, n: int, include_usage: bool,
                           logprobs: bool, top: int) -> AsyncIterator[str]:
        model = self.config.served_model_name

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return _event(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                              usage=usage))

        sent: dict[int, _Sent] = {}
        final = None
        try:
            for index in range(n):
                yield chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
            async for final in stream:
                for c in final.outputs:
                    delta = sent.setdefault(c.index, _Sent()).advance(c)
                    if delta is None:
                        continue
                    text, ids, lps, _ = delta
                    if not text and not c.finished and not (logprobs and lps):
                        continue
                    yield chunk([ChatChunkChoice(
                        index=c.index, delta=Delta(content=text) if text or not c.finished else Delta(),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        logprobs=_chat_logprobs(lps, ids, top) if logprobs and lps is not None else None)])
            if include_usage and final is not None:
                yield chunk([], self._usage([final]))
        except Exception as e:
            yield f"data: {_dump(error_body(_engine_error(e)))}\n\n"
        finally:
            stream.close()
        yield "data: [DONE]\n\n"


# -- helpers --------------------------------------------------------------------------------------


class _Sent:
    """How much of one choice a stream has sent: the next delta from a cumulative output."""

    def __init__(self):
        self.text = 0
        self.tokens = 0
        self.offset = 0  # text offset of the next token's logprob entry
        self.done = False

    def advance(self, c: CompletionOutput) -> tuple[str, list[int], list | None, int] | None:
        """(text delta, new token ids, their logprob entries, text offset of the first), or None
        when nothing changed."""
        if self.done:
            return None
        text = c.text[self.text:]
        new_tokens = len(c.token_ids) - self.tokens
        if not text and not new_tokens and not c.finished:
            return None
        ids = c.token_ids[self.tokens:]
        lps = c.logprobs[self.tokens:] if c.logprobs is not None else None
        offset = self.offset
        if lps:
            self.offset += sum(len(_token_text(entry, tid)) for entry, tid in zip(lps, ids))
        self.text, self.tokens, self.done = len(c.text), len(c.token_ids), c.finished
        return text, ids, lps, offset


def _prompt_list(prompt) -> list:
    """`prompt` as a list of prompts (text, or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _chat_messages(body: ChatCompletionRequest) -> list[dict]:
    messages = []
    for i, message in enumerate(body.messages):
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

    def build() -> list[int]:
        tokenizer = engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return build


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(stream.__anext__()): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _token_text(entry: dict, token_id: int) -> str:
    logprob = entry.get(token_id)
    return (logprob.decoded_token if logprob is not None else None) or ""


def _completion_logprobs(lps: list[dict] | None, token_ids: list[int], offset: int) -> CompletionLogprobs:
    """OpenAI's legacy shape; `top_logprobs` maps the top n tokens and the sampled one to logprobs."""
    result = CompletionLogprobs()
    for entry, sampled in zip(lps or [], token_ids):
        token = _token_text(entry, sampled)
        result.tokens.append(token)
        result.token_logprobs.append(entry[sampled].logprob)
        result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def _chat_logprobs(lps: list[dict] | None, token_ids: list[int], top: int) -> ChatLogprobs:
    content = []
    for entry, sampled in zip(lps or [], token_ids):
        token = _token_text(entry, sampled)
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)[:top]
        content.append(TokenLogprob(
            token=token, logprob=entry[sampled].logprob, bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                     bytes=list((lp.decoded_token or "").encode())) for lp in ranked]))
    return ChatLogprobs(content=content)


def _dump(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _event(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


# -- `blockserve serve` ---------------------------------------------------------------------------


def run_server(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """Load the model (logging its KV capacity), then serve until interrupted."""
    import uvicorn

    api_keys = tuple(args.api_key or ()) or tuple(
        key for key in os.environ.get("BLOCKSERVE_API_KEY", "").split(",") if key)
    config = ServerConfig(args.served_model_name or args.model or DEFAULT_MODEL_NAME, api_keys,
                          args.prefix_cache_isolation)
    engine = LLMEngine(engine_config)
    app = create_app(engine, config)
    logger.info("serving %r on http://%s:%d (API keys: %s, prefix-cache isolation: %s)", config.served_model_name,
                args.host, args.port, len(api_keys) or "none", config.prefix_cache_isolation)
    # uvicorn's own logs (start-up, access lines) stay at warnings; ours follow the CLI's -q.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
