"""A client that stops reading a stream, in-process: the ASGI `send` blocks (as uvicorn's does
once the socket buffers are full) after the first event. While it blocks the engine keeps
generating, yet the request's stream holds at most one undelivered output; after
--stream-stall-timeout the request is aborted (finish reason "stalled", its blocks freed), the
response ends, and a request beside it is untouched.

In-process rather than over a real socket: on loopback the kernel autotunes a socket's send
buffer up to tcp_wmem's maximum (4 MiB here), more than a whole max-length stream of the
bundled model, so a real non-reading client never makes the send block within a test's time."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import LlamaConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.server.config import ServerConfig
from tests.server.test_async_engine import SIZES
from tests.server.test_backpressure import assert_idle, call, metrics, serve
from tests.server.test_deadlines import slow_steps

STALL_S = 1.0
STREAM = {"prompt": [5, 6, 7], "max_tokens": 55, "ignore_eos": True, "temperature": 0, "stream": True,
          "logprobs": 0}  # ~1.1 s of slowed steps: it outlives the stall timeout


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return load_model(str(path), BACKENDS["exact"])


async def never_reading_client(app, body: dict, bodies_read: int) -> list[dict]:
    """POST `body`; the client takes `bodies_read` body messages, then reads nothing (every later
    send blocks until the app gives up on it). Returns the messages it took."""
    incoming = [{"type": "http.request", "body": json.dumps(body).encode()}]
    taken = []

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.Event().wait()  # still connected

    async def send(message):
        if message["type"] == "http.response.body" and sum(m["type"] == "http.response.body" for m in taken) >= bodies_read:
            await asyncio.Event().wait()  # the socket buffers are full
        taken.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return taken


def test_a_client_that_stops_reading_is_aborted_after_the_stall_timeout_with_one_output_buffered(model):
    async def body(app, engine):
        slow_steps(engine)
        async_engine = app.state.async_engine
        stalled = asyncio.ensure_future(never_reading_client(app, STREAM, bodies_read=1))
        neighbour = asyncio.ensure_future(call(app, "POST", "/v1/completions",
                                               {**STREAM, "stream": False, "max_tokens": 30}))
        buffered, generated = [], []
        give_up = asyncio.get_running_loop().time() + STALL_S + 10
        while not stalled.done() and asyncio.get_running_loop().time() < give_up:  # sample the stalled stream's buffer while the engine works on
            buffered += [s.buffered for s in async_engine._open if s.request_id.startswith("cmpl-")]
            generated.append((await metrics(app))["blockserve_generation_tokens_total"])
            await asyncio.sleep(0.05)
        taken = await asyncio.wait_for(stalled, 1)
        assert [m["type"] for m in taken] == ["http.response.start", "http.response.body"]  # then it ended unfinished
        assert max(buffered) == 1 and generated[-1] - generated[0] > 10  # tokens came; one output held
        status, _, raw = await neighbour
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 30
        m = await assert_idle(app, engine)  # the stalled request's blocks are free
        assert m["blockserve_request_finished_total{finished_reason=stalled}"] == 1
        assert m["blockserve_generation_tokens_total"] < 30 + STREAM["max_tokens"]  # it did not run to its end
        again = await call(app, "POST", "/v1/completions", {**STREAM, "max_tokens": 3})
        assert again[0] == 200 and again[2].endswith(b"data: [DONE]\n\n")

    serve(model, ServerConfig(stream_stall_timeout=STALL_S), body)
