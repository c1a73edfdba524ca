"""Backpressure through the app in-process (plain ASGI calls) on a tiny random Llama: with tiny
bounds on the waiting queue, a burst gets 503s with Retry-After in OpenAI's shape, the accepted
requests all complete, /metrics counts the rejections, and nothing is left behind.

The engine thread is held (a call that waits on an event) while the burst arrives, so every add
of the burst is decided in one go, before any step: exactly the bound is accepted."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.server.config import ServerConfig
from tests.server.asgi import asgi_request, serve_app
from tests.server.test_async_engine import ARGS, SIZES

MAX_TOKENS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return load_model(str(path), BACKENDS["exact"])


async def call(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body)."""
    return await asgi_request(app, method, path, body)


def serve(model, config: ServerConfig, body):
    """Run `body(app, engine)` with the app's lifespan (the engine thread) around it."""
    return serve_app(model, ARGS, body, config)


async def burst(app, prompts: list[list[int]]) -> list[tuple[int, dict, bytes]]:
    """Send every prompt at once while the engine thread is held, so all adds are decided before a step."""
    async_engine = app.state.async_engine
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait()

    held = asyncio.ensure_future(async_engine.call(hold))
    try:
        await asyncio.to_thread(holding.wait)  # the engine thread is in the call: the queue holds only the burst
        tasks = [asyncio.ensure_future(call(app, "POST", "/v1/completions",
                                            {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}))
                 for p in prompts]
        while async_engine._commands.qsize() < len(prompts) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.01)
    finally:
        release.set()
    await held
    return await asyncio.gather(*tasks)


async def metrics(app) -> dict[str, float]:
    status, _, raw = await call(app, "GET", "/metrics")
    assert status == 200
    values = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


async def assert_idle(app, engine) -> dict[str, float]:
    """Nothing runs, waits, queues or holds a block, on the engine thread and in /metrics."""
    async_engine = app.state.async_engine
    while await async_engine.call(engine.has_unfinished_requests):
        await asyncio.sleep(0.01)
    stats = await async_engine.call(engine.stats)
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == [0.0]
    m = await metrics(app)
    assert m["blockserve_queue_requests"] == m["blockserve_queue_prompt_tokens"] == 0
    return m


def check_rejections(results, accepted: int, reason_word: str) -> None:
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] != 200]
    assert len(ok) == accepted, [r[0] for r in results]
    for _, _, raw in ok:  # the accepted ones all complete
        assert json.loads(raw)["usage"]["completion_tokens"] == MAX_TOKENS
    for status, headers, raw in rejected:
        body = json.loads(raw)
        assert status == 503 and headers["retry-after"] == "1", (status, headers)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "server_overloaded" and body["error"]["type"] == "server_error"
        assert reason_word in body["error"]["message"] and "retry later" in body["error"]["message"]


def test_a_burst_past_max_waiting_requests_gets_503_with_retry_after(model):
    config = ServerConfig(max_waiting_requests=2)

    async def body(app, engine):
        results = await burst(app, [[1 + i, 2, 3, 4] for i in range(8)])
        check_rejections(results, accepted=2, reason_word="--max-waiting-requests 2")
        m = await assert_idle(app, engine)
        assert m["blockserve_requests_rejected_total{reason=waiting_requests}"] == 6
        again = await call(app, "POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": MAX_TOKENS})
        assert again[0] == 200  # the queue drained: served again

    serve(model, config, body)


def test_a_burst_past_max_waiting_tokens_gets_503_and_a_long_prompt_alone_is_taken(model):
    config = ServerConfig(max_waiting_tokens=20)

    async def body(app, engine):
        results = await burst(app, [[1 + i] * 8 for i in range(6)])  # 8 + 8 fit in 20; a third would not
        check_rejections(results, accepted=2, reason_word="--max-waiting-tokens 20")
        m = await assert_idle(app, engine)
        assert m["blockserve_requests_rejected_total{reason=waiting_tokens}"] == 4
        alone = await call(app, "POST", "/v1/completions", {"prompt": [7] * 30, "max_tokens": MAX_TOKENS})
        assert alone[0] == 200  # over the bound, but nothing waits: it would never be served otherwise
        await assert_idle(app, engine)

    serve(model, config, body)


def test_waiting_bounds_must_bound():
    for name in ("max_waiting_requests", "max_waiting_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be at least 1"):
            ServerConfig(**{name: 0})
    with pytest.raises(ValueError, match="shutdown_timeout"):
        ServerConfig(shutdown_timeout=-1)
