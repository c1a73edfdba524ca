"""Deadlines through the app in-process on a tiny random Llama whose steps are slowed down: a
request past its deadline (the body's request_timeout, or the server's --request-timeout) is
aborted in the engine; a plain client gets 504 `request_timeout` in OpenAI's shape, a streaming
one an error event then [DONE]; its blocks are free at once, /metrics counts it, and the
requests beside it are untouched."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from transformers import LlamaConfig

from blockserve import SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.server.config import ServerConfig
from blockserve.server.http.errors import RequestTimeout
from tests.server.asgi import sse_events
from tests.server.test_async_engine import SIZES
from tests.server.test_backpressure import assert_idle, call, serve

STEP_S = 0.02  # each step is slowed to this, so a long request outlives a short deadline
LONG = {"prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True, "temperature": 0}  # ~1 s of steps


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return load_model(str(path), BACKENDS["exact"])


def slow_steps(engine) -> None:
    """Every step of this engine's runner takes at least STEP_S (only this engine's runner)."""
    execute = engine.core.runner.execute

    def slow(out):
        time.sleep(STEP_S)
        return execute(out)

    engine.core.runner.execute = slow


def error_of(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_past_its_deadline_a_request_gets_504_its_blocks_are_freed_and_the_others_finish(model):
    async def body(app, engine):
        slow_steps(engine)
        timed_out, neighbour = await asyncio.gather(
            call(app, "POST", "/v1/completions", {**LONG, "request_timeout": 0.3}),
            call(app, "POST", "/v1/completions", {**LONG, "max_tokens": 20}))
        status, _, raw = timed_out
        error = error_of(raw)
        assert status == 504 and error["code"] == "request_timeout" and error["type"] == "server_error", raw
        assert "0.3 s" in error["message"] and "--request-timeout" in error["message"]
        assert neighbour[0] == 200 and json.loads(neighbour[2])["usage"]["completion_tokens"] == 20
        m = await assert_idle(app, engine)  # its blocks were freed; nothing waits
        assert m["blockserve_request_finished_total{finished_reason=timeout}"] == 1
        assert m["blockserve_request_finished_total{finished_reason=length}"] == 1
        generated = m["blockserve_generation_tokens_total"]
        assert 20 <= generated < 20 + 50  # the timed-out one stopped part way

    serve(model, ServerConfig(), body)


def test_the_blocks_are_free_right_after_the_deadline(model):
    async def body(app, engine):
        slow_steps(engine)
        async_engine = app.state.async_engine
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        stream = await async_engine.add_request("r", [5, 6, 7] * 4, params, timeout=0.2)
        first = await stream.__anext__()
        assert first.outputs[0].token_ids and not first.finished
        stats = await async_engine.call(engine.stats)
        assert stats.kv_usage[0] > 0  # it holds blocks while it runs
        with pytest.raises(RequestTimeout):
            async for _ in stream:
                pass
        stats = await async_engine.call(engine.stats)  # the abort ran before this call
        assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == [0.0]
        stream.close()
        await assert_idle(app, engine)

    serve(model, ServerConfig(), body)


def test_a_stream_past_its_deadline_ends_in_an_error_event(model):
    async def body(app, engine):
        slow_steps(engine)
        status, headers, raw = await call(app, "POST", "/v1/completions",
                                          {**LONG, "stream": True, "logprobs": 0, "request_timeout": 0.3})
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout", events[-3:]
        tokens = [e for e in events[:-2] if "choices" in e]
        assert 0 < len(tokens) < 50  # some tokens streamed before the deadline (one event each), not all
        m = await assert_idle(app, engine)
        assert m["blockserve_request_finished_total{finished_reason=timeout}"] == 1

    serve(model, ServerConfig(), body)


def test_the_server_default_applies_and_the_body_may_only_shorten_it(model):
    async def body(app, engine):
        slow_steps(engine)
        status, _, raw = await call(app, "POST", "/v1/completions", LONG)
        assert status == 504 and "0.25 s" in error_of(raw)["message"], raw  # --request-timeout 0.25
        for bad, words in ((5, "longer than this server allows (0.25 s, --request-timeout)"),
                           (0, "greater than 0"), (-1, "greater than 0"), ("soon", "valid number")):
            status, _, raw = await call(app, "POST", "/v1/completions", {**LONG, "request_timeout": bad})
            error = error_of(raw)
            assert status == 400 and error["param"] == "request_timeout" and words in error["message"], raw
        await assert_idle(app, engine)

    serve(model, ServerConfig(request_timeout=0.25), body)


def test_timeouts_must_be_positive():
    for name in ("request_timeout", "stream_stall_timeout"):
        with pytest.raises(ValueError, match=f"{name} must be > 0"):
            ServerConfig(**{name: 0})

