"""The OpenAI-compatible HTTP API over an AsyncEngine: the app and its routes.

    GET  /                        the chat page (http/chat_page.py, http/static/chat.html)
    GET  /v1/models               the served model
    POST /v1/completions          text completions (completions.py); stream: SSE chunks, then `data: [DONE]`
    POST /v1/chat/completions     chat completions, through the model's chat template (chat.py)
    GET  /health                  200 while the engine runs; 503 once it stopped or while it drains (the body says)
    GET  /metrics                 Prometheus text format (metrics.py)
    GET  /openapi.json            the OpenAPI document: request constraints, every answer (openapi.py)
    POST /reset_prefix_cache      200, or 409 / 400 with the reason it cannot
    POST /tokenize, /detokenize   a prompt or messages to token ids, and token ids to text (tokenize.py)

Errors are OpenAI's shape (http/errors.py): 400 for invalid parameters, an unknown model, a
prompt over the model's length or a request past a limit (limits.py; 413 for the body's size);
401 for a missing or wrong API key (auth.py); 404 / 405 for unknown routes; 503 once the engine
stopped, and 503 with Retry-After while the waiting queue is full (`--max-waiting-requests` /
`--max-waiting-tokens`), the server drains or holds `--max-connections` connections
(http/connection_cap.py); 504 past a request's deadline (`--request-timeout`,
the body's `request_timeout`); 500 when the engine step running it failed, or for anything
unexpected. A request's error touches that request only. A client that disconnects has its requests aborted (streaming.py).
SIGTERM / SIGINT drain (`run_server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from blockserve.engine.config import EngineConfig
from blockserve.engine.llm_engine import LLMEngine
from blockserve.server.engine_bridge.async_engine import AsyncEngine
from blockserve.server.http.auth import AuthMiddleware
from blockserve.server.openai_api.chat import create_chat_completion
from blockserve.server.http.chat_page import chat_page_router
from blockserve.server.openai_api.completions import create_completion
from blockserve.server.config import ServerConfig
from blockserve.server.http.draining import serve_with_drain
from blockserve.server.http.errors import APIError, Draining, add_exception_handlers, error_response
from blockserve.server.http.limits import RequestLimitsMiddleware, check_request_limits
from blockserve.server.engine_bridge.metrics import CONTENT_TYPE, Metrics
from blockserve.server.openai_api.openapi import answers, install_openapi
from blockserve.server.openai_api.request_rules import Limits
from blockserve.server.protocol import (
    ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, DetokenizeResponse, ModelCard, ModelList,
    TokenizeResponse,
)
from blockserve.server.openai_api.tokenize import detokenize, tokenize
from blockserve.server.tools.hermes import renders_hermes_tools

logger = logging.getLogger("blockserve.server")


def create_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and joins it on shutdown."""
    config = config or ServerConfig()
    metrics = Metrics(config.served_model_name, lambda: async_engine.stats, lambda: async_engine.queue)
    async_engine = AsyncEngine(engine, metrics, max_waiting_requests=config.max_waiting_requests,
                               max_waiting_tokens=config.max_waiting_tokens, request_timeout=config.request_timeout,
                               stream_stall_timeout=config.stream_stall_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="blockserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    # the real answers (400s in OpenAI's shape, never 422), streams, the tokenize bodies, what requests must be
    install_openapi(app, lambda: Limits(config, engine.vocab_size, async_engine.max_model_len,
                                        renders_hermes_tools(engine.tokenizer)))
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=config.max_request_body_bytes,
                       max_json_depth=config.max_json_depth, body_timeout=config.body_timeout)
    app.add_middleware(AuthMiddleware, api_keys=config.api_keys,  # outermost: a stranger's body is never read
                       open_operations=config.open_health_and_metrics)
    add_exception_handlers(app)
    app.include_router(chat_page_router())  # GET /: the chat page

    @app.get("/health", responses=answers(503))
    async def health():
        if not async_engine.is_alive:
            return error_response(APIError(503, "the engine is not running", code="engine_unavailable"))
        if async_engine.draining:
            return error_response(Draining())
        return Response(status_code=200)

    @app.get("/metrics", responses=answers(ok_media=CONTENT_TYPE))
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=answers(ok=ModelList))
    async def models():
        return ModelList(data=[ModelCard(id=config.served_model_name, max_model_len=async_engine.max_model_len)])

    @app.post("/reset_prefix_cache", responses=answers(400, 409, 413, 503, ok={
        "type": "object", "properties": {"success": {"type": "boolean"}}, "required": ["success"]}))
    async def reset_prefix_cache():
        if not engine.config.enable_prefix_caching:
            raise APIError(400, "prefix caching is disabled on this server", code="prefix_caching_disabled")
        ok, reason = await async_engine.reset_prefix_cache()  # EngineDead: a 503
        if not ok:
            raise APIError(409, f"prefix cache not reset: {reason}", code="blocks_in_use")
        return {"success": True}

    @app.post("/v1/completions", responses=answers(400, 413, 503, 504, ok=Completion, stream=True))
    async def completions(body: CompletionRequest, request: Request):
        check_request_limits(body, config)
        return await create_completion(async_engine, config, body, request)

    @app.post("/v1/chat/completions", responses=answers(400, 413, 503, 504, ok=ChatCompletion, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request_limits(body, config)
        return await create_chat_completion(async_engine, config, body, request)

    @app.post("/tokenize", responses=answers(400, 413, 503, ok=TokenizeResponse))
    async def tokenize_route(request: Request):
        return await tokenize(async_engine, config, request)

    @app.post("/detokenize", responses=answers(400, 413, 503, ok=DetokenizeResponse))
    async def detokenize_route(request: Request):
        return await detokenize(async_engine, config, request)

    return app


# -- `blockserve serve` ---------------------------------------------------------------------------


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Load the model (logging its KV capacity), then serve until SIGTERM / SIGINT, which drains:
    the port stays open and answers new requests 503 (/health too), in-flight requests get up to
    `config.shutdown_timeout` seconds, the rest are aborted with an error. Returns 0 after a
    drain; 1 if a second signal cut it short."""
    engine = LLMEngine(engine_config)
    app = create_app(engine, config)
    async_engine: AsyncEngine = app.state.async_engine
    freeze_startup_heap()

    async def drain(name: str) -> None:
        logger.info("%s: draining, then exiting", name)
        await async_engine.drain(config.shutdown_timeout)

    logger.info("serving %r on http://%s:%d (API keys: %s, prefix-cache isolation: %s)", config.served_model_name,
                config.host, config.port, len(config.api_keys) or "none", config.prefix_cache_isolation)
    try:
        if not serve_with_drain(app, config, drain):
            logger.warning("a second signal: exited without finishing the drain")
            return 1
        return 0
    finally:
        engine.close()  # the engine thread has stopped: join the KV writer, stop the ranks


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then move every object still alive (the imports of torch,
    transformers and the server, the model's modules: ~400k objects) into the garbage collector's
    permanent generation. A full collection scans every tracked object, so unfrozen, the ones serving
    triggers stall every stream while the engine thread holds the GIL (measured in
    docs/performance.md); frozen, a collection scans only what serving allocated. The cost: a reference
    cycle among the frozen objects is never collected (the process serves until it exits). vLLM freezes
    its engine process's heap after start-up the same way."""
    gc.collect()
    gc.freeze()
    logger.info("froze %d objects alive after start-up out of the garbage collector's scans", gc.get_freeze_count())
