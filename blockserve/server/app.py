"""The OpenAI-compatible HTTP API over an AsyncEngine: the app and its routes.

    GET  /v1/models               the served model
    POST /v1/completions          text completions (completions.py); stream: SSE chunks, then `data: [DONE]`
    POST /v1/chat/completions     chat completions, through the model's chat template (chat.py)
    GET  /health                  200 while the engine runs, 503 once it stopped
    GET  /metrics                 Prometheus text format (metrics.py)
    POST /reset_prefix_cache      200, or 409 / 400 with the reason it cannot
    POST /tokenize, /detokenize   a prompt or messages to token ids, and token ids to text (tokenize.py)

Errors are OpenAI's shape (http_errors.py): 400 for invalid parameters, an unknown model or a
prompt over the model's length; 401 for a missing or wrong API key (auth.py); 404 / 405 for
unknown routes; 503 once the engine stopped; 500 for anything unexpected. A request's error
touches that request only. A client that disconnects has its requests aborted (streaming.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from blockserve.engine.config import EngineConfig
from blockserve.engine.llm_engine import LLMEngine
from blockserve.server.async_engine import AsyncEngine
from blockserve.server.auth import AuthMiddleware
from blockserve.server.chat import create_chat_completion
from blockserve.server.completions import create_completion
from blockserve.server.config import ServerConfig
from blockserve.server.http_errors import APIError, add_exception_handlers, error_response
from blockserve.server.metrics import CONTENT_TYPE, Metrics
from blockserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from blockserve.server.tokenize import detokenize, tokenize

logger = logging.getLogger("blockserve.server")


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
    app.add_middleware(AuthMiddleware, api_keys=config.api_keys)
    add_exception_handlers(app)

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
        ok, reason = await async_engine.reset_prefix_cache()  # EngineDead: a 503
        if not ok:
            raise APIError(409, f"prefix cache not reset: {reason}", code="blocks_in_use")
        return {"success": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(async_engine, config, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(async_engine, config, body, request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize(async_engine, config, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(async_engine, config, request)

    return app


# -- `blockserve serve` ---------------------------------------------------------------------------


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Load the model (logging its KV capacity), then serve until interrupted."""
    import uvicorn

    engine = LLMEngine(engine_config)
    app = create_app(engine, config)
    logger.info("serving %r on http://%s:%d (API keys: %s, prefix-cache isolation: %s)", config.served_model_name,
                config.host, config.port, len(config.api_keys) or "none", config.prefix_cache_isolation)
    # uvicorn's own logs (start-up, access lines) stay at warnings; ours follow the CLI's -q.
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
