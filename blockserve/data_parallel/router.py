"""The data-parallel front end (`blockserve serve --data-parallel-size N`): one HTTP server that
proxies to N engine replicas (replicas.py), each request to the replica routing.py picks.

    POST /v1/completions, /v1/chat/completions   routed by prefix affinity and load; streams pass
                                                 through as the replica sends them
    POST /tokenize, /detokenize, GET /v1/models  to the least loaded replica
    GET  /health                                 200 {"status": "ok" | "degraded", "replicas": [...]}
                                                 while a replica lives; 503 when none does or while draining
    GET  /metrics                                each replica's metrics labelled replica="i", their totals
                                                 replica="total", and the router's own (requests routed by
                                                 reason, replicas up and scraped, in flight): metrics.py

The front end tokenizes each prompt with the model's tokenizer (chat messages through its chat
template) to hash its leading blocks; a prompt it cannot tokenize is routed by load, and the
replica answers it as it would any. A replica that exits or refuses connections leaves the
rotation; requests in flight on it get 503 (an error event on a stream already started); a
request it refused the connection to goes to the next replica. A client that disconnects has its
connection to the replica closed, which aborts the request there.
SIGTERM / SIGINT drain: new requests get 503, the replicas drain (each its --shutdown-timeout)
and exit, then the front end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator

import anyio
import httpx2 as httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from blockserve.engine.config import EngineConfig
from blockserve.engine.template_kwargs import template_kwargs
from blockserve.engine.tokenizer import load_tokenizer
from blockserve.server.http.auth import AuthMiddleware, cache_salt
from blockserve.server.config import ServerConfig
from blockserve.server.http.draining import KEEP_ALIVE_S, serve_with_drain
from blockserve.server.http.errors import APIError, Draining, error_body, error_response
from blockserve.server.http.limits import RequestLimitsMiddleware
from blockserve.server.engine_bridge.metrics import CONTENT_TYPE
from blockserve.data_parallel.metrics import ReplicaMetrics, merge, parse, render, router_families
from blockserve.data_parallel.replicas import ReplicaProcess, start_replicas, stop_replicas
from blockserve.data_parallel.routing import (
    REASONS, DataParallelConfig, PrefixIndex, ReplicaLoad, RoutingPolicy, prefix_hashes,
)

logger = logging.getLogger("blockserve.server")

_WATCH_INTERVAL_S = 0.5  # how often replica processes are polled for an exit
_FORWARDED_HEADERS = ("authorization", "content-type")
_CLIENT_CLOSED = 499  # the status logged for a request whose client left before its answer (nginx's)


def prompt_token_ids(tokenizer, path: str, body) -> list[int] | None:
    """The token ids of a completion's (first) prompt or a chat's messages through the chat template
    with the request's chat_template_kwargs and add_generation_prompt (tools left out); None when
    they cannot be told here (the replica validates the request)."""
    if not isinstance(body, dict):
        return None
    try:
        if path == "/v1/chat/completions":
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                return None
            variables = template_kwargs(body.get("chat_template_kwargs"))
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=body.get(
                "add_generation_prompt", True) is not False, tokenize=True, **variables)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, str):
            return None if tokenizer is None else tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
            return prompt
    except Exception:  # a malformed body or a template that rejects it: the replica's 400 to give
        return None
    return None


class Replicas:
    """The replicas' processes, their routing state and an HTTP client to them."""

    def __init__(self, processes: list[ReplicaProcess], dp_config: DataParallelConfig):
        self.processes = processes
        self.loads = [ReplicaLoad(p.index, PrefixIndex(dp_config.dp_index_blocks)) for p in processes]
        self.policy = RoutingPolicy(self.loads, dp_config)
        self.routed = dict.fromkeys(REASONS, 0)
        # An idle connection is dropped here well before a replica's server closes it (KEEP_ALIVE_S),
        # so a request is never sent on a connection that the replica is closing at that moment.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEP_ALIVE_S / 2))
        self.draining = False
        self.metrics: list[ReplicaMetrics | None] = [None] * len(processes)  # each one's last /metrics

    def mark_dead(self, index: int, why: str) -> None:
        if self.loads[index].alive:
            self.loads[index].alive = False
            level = logging.INFO if self.draining else logging.ERROR  # exiting is what a drain asks of it
            logger.log(level, "replica %d (pid %d) is out of rotation: %s", index, self.processes[index].pid, why)

    def check_processes(self) -> None:
        for process in self.processes:
            if process.exited():
                self.mark_dead(process.index, f"its process exited with {process.process.returncode}")

    def status(self) -> list[dict]:
        return [{"replica": p.index, "pid": p.pid, "port": p.port, "alive": load.alive, "in_flight": load.in_flight,
                 "routed": load.routed, "indexed_blocks": len(load.prefixes)}
                for p, load in zip(self.processes, self.loads)]


async def _client_left(request: Request) -> None:
    """Returns once the client disconnects (its request body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Relay(StreamingResponse):
    """A replica's event stream relayed as it comes; a transport error mid-stream ends it with an
    error event. However the response ends (done, the client gone, the server stopping), the
    connection to the replica is closed (so a replica whose client left aborts the request) and
    `on_end` runs, once."""

    def __init__(self, upstream: httpx.Response, index: int, on_end, on_error):
        self._upstream = upstream
        self._on_end = on_end

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                on_error()
                error = APIError(503, f"replica {index} failed mid-stream ({type(e).__name__})",
                                 code="replica_unavailable")
                yield f"data: {json.dumps(error_body(error), separators=(',', ':'))}\n\n".encode()

        super().__init__(events(), status_code=upstream.status_code, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self._upstream.aclose()
            finally:
                self._on_end()


def _unavailable(message: str) -> JSONResponse:
    return error_response(APIError(503, message, code="replica_unavailable"))


def create_router_app(replicas: Replicas, engine_config: EngineConfig, config: ServerConfig, tokenizer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def watch() -> None:
            while True:
                replicas.check_processes()
                await asyncio.sleep(_WATCH_INTERVAL_S)

        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()
            await replicas.client.aclose()

    app = FastAPI(title="blockserve data-parallel front end", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=config.max_request_body_bytes,
                       max_json_depth=config.max_json_depth, body_timeout=config.body_timeout)
    app.add_middleware(AuthMiddleware, api_keys=config.api_keys, open_operations=config.open_health_and_metrics)

    async def exchange(request: Request, load: ReplicaLoad, body: bytes | None) -> Response | None:
        """Send `request` to replica `load` and answer with what it answers (a stream relayed as it
        comes); None if it refused the connection (it is out of rotation). The replica is finished
        (its in-flight count dropped) once the answer has ended, however it ends."""
        process = replicas.processes[load.index]
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        outgoing = replicas.client.build_request(request.method, process.base_url + request.url.path,
                                                 content=body, headers=headers)
        relayed = False
        try:
            try:
                upstream = await replicas.client.send(outgoing, stream=True)
            except httpx.ConnectError as e:  # the request never reached it: `route` tries the next replica
                replicas.mark_dead(load.index, f"connection refused ({e})")
                return None
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                relayed = True
                return _Relay(upstream, load.index, on_end=lambda: RoutingPolicy.finish(load),
                              on_error=replicas.check_processes)
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"),
                            headers={k: v for k, v in upstream.headers.items() if k.lower() == "retry-after"})
        except httpx.HTTPError as e:
            replicas.check_processes()
            return _unavailable(f"replica {load.index} failed while serving the request ({type(e).__name__}); "
                                "retry the request")
        finally:
            if not relayed:
                RoutingPolicy.finish(load)

    async def forward(request: Request, load: ReplicaLoad, body: bytes | None) -> Response | None:
        """`exchange`, given up as soon as the client disconnects: the connection to the replica is
        closed, so the replica sees its client leave and aborts the request (its blocks freed)."""
        answer = asyncio.ensure_future(exchange(request, load, body))
        left = asyncio.ensure_future(_client_left(request))
        try:
            await asyncio.wait([answer, left], return_when=asyncio.FIRST_COMPLETED)
            if not answer.done() and left.exception() is not None:
                logger.warning("cannot watch for the client leaving: %r", left.exception())
                await asyncio.wait([answer])
            if answer.done():
                return answer.result()
        finally:
            left.cancel()
            if not answer.done():
                answer.cancel()
                await asyncio.wait([answer])
        logger.info("the client left before replica %d answered: its request there was closed", load.index)
        return Response(status_code=_CLIENT_CLOSED)

    async def route(request: Request, hashes, body: bytes | None) -> Response:
        """Forward to the replica the policy picks; one that refuses the connection leaves the
        rotation and the request goes to the next pick (503 once none is alive)."""
        while True:
            load = pick(hashes)
            if isinstance(load, Response):
                return load
            answer = await forward(request, load, body)
            if answer is not None:
                return answer

    def pick(hashes) -> ReplicaLoad | Response:
        if replicas.draining:
            return error_response(Draining())
        chosen = replicas.policy.choose(hashes)
        if chosen is None:
            return _unavailable("no engine replica is alive")
        load, reason = chosen
        replicas.routed[reason] += 1
        return load

    async def generate(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        ids = await asyncio.to_thread(prompt_token_ids, tokenizer, request.url.path, body)
        hashes = []
        if ids is not None:
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            hashes = prefix_hashes(ids, engine_config.block_size, cache_salt(config, request, salt))
        return await route(request, hashes, raw)

    async def by_load(request: Request) -> Response:
        return await route(request, [], await request.body() or None)

    app.add_api_route("/v1/completions", generate, methods=["POST"])
    app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
    app.add_api_route("/tokenize", by_load, methods=["POST"])
    app.add_api_route("/detokenize", by_load, methods=["POST"])
    app.add_api_route("/v1/models", by_load, methods=["GET"])

    @app.get("/health")
    async def health():
        replicas.check_processes()
        status = replicas.status()
        alive = sum(r["alive"] for r in status)
        if replicas.draining:
            return error_response(Draining())
        if not alive:
            return JSONResponse({"status": "unavailable", "replicas": status}, status_code=503)
        return {"status": "ok" if alive == len(status) else "degraded", "replicas": status}

    @app.get("/metrics")
    async def metrics(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}

        async def scrape(process: ReplicaProcess) -> None:
            alive = replicas.loads[process.index].alive
            last = replicas.metrics[process.index]
            families = last.families if last is not None else ()
            if alive:
                try:
                    answer = await replicas.client.get(process.base_url + "/metrics", headers=headers, timeout=10)
                    if answer.status_code == 200:
                        replicas.metrics[process.index] = ReplicaMetrics(parse(answer.text), alive=True, scraped=True)
                        return
                    logger.warning("replica %d: /metrics answered %d", process.index, answer.status_code)
                except (httpx.HTTPError, ValueError) as e:  # unreachable, or not exposition text
                    logger.warning("replica %d: /metrics could not be read (%s)", process.index, e)
            if last is not None:
                replicas.metrics[process.index] = ReplicaMetrics(families, alive=alive, scraped=False)

        replicas.check_processes()
        await asyncio.gather(*(scrape(p) for p in replicas.processes))
        status = [(p.index, load.alive, bool(m and m.scraped), load.in_flight)
                  for p, load, m in zip(replicas.processes, replicas.loads, replicas.metrics)]
        return Response(render([*merge(replicas.metrics), *router_families(replicas.routed, status)]),
                        media_type=CONTENT_TYPE)

    return app


# -- `blockserve serve --data-parallel-size N` ----------------------------------------------------


@contextlib.contextmanager
def _terminate_raises():
    """SIGTERM raises SystemExit inside the block (as SIGINT raises KeyboardInterrupt), so the
    `except` / `finally` clauses that stop the replicas run; the handler before it is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the stopping short
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_router(engine_config: EngineConfig, config: ServerConfig, dp_config: DataParallelConfig,
               quiet: bool = False) -> int:
    """Start the replicas, then serve the front end until SIGTERM / SIGINT, which drains: new
    requests get 503, the replicas drain and exit, then the front end. Returns 0 after a drain."""
    if engine_config.tensor_parallel_size > 1 and engine_config.distributed_executor == "external":
        raise ValueError("--data-parallel-size > 1 starts its replicas on this host, so each replica's tensor-parallel "
                         "ranks must be too: drop --distributed-executor external")
    with _terminate_raises():  # a SIGTERM while the replicas start stops them, not just the front end
        processes = start_replicas(engine_config, config, quiet=quiet, startup_timeout=dp_config.dp_startup_timeout)
        try:
            tokenizer = load_tokenizer(engine_config)
            replicas = Replicas(processes, dp_config)
            app = create_router_app(replicas, engine_config, config, tokenizer)
        except BaseException:
            stop_replicas(processes, timeout=0)
            raise

    async def drain(name: str) -> None:
        logger.info("%s: draining the replicas, then exiting", name)
        replicas.draining = True
        await asyncio.to_thread(stop_replicas, processes, config.shutdown_timeout)

    logger.info("serving %r on http://%s:%d through %d replicas (routing: %s)", config.served_model_name,
                config.host, config.port, len(processes), dp_config.dp_routing)
    drained = False
    try:
        drained = serve_with_drain(app, config, drain)
    finally:
        stop_replicas(processes, timeout=config.shutdown_timeout if drained else 0)
    return 0 if drained else 1
