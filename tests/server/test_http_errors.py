"""The exception -> status mapping: bad input is a 400 with its code, a dead engine a 503, and
anything else a 500 whose traceback is logged and never sent. Checked on the function, then
through the app in-process (plain ASGI calls) on a tiny random Llama with token-id prompts."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import LlamaConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.errors import EngineDead, InvalidRequest, PromptTooLong, RequestRejected
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.server.http.errors import from_exception
from tests.server.asgi import asgi_request, serve_app
from tests.server.test_async_engine import ARGS, SIZES


@pytest.mark.parametrize("error, status, code, param", [
    (InvalidRequest("bad", param="stop"), 400, "invalid_value", "stop"),
    (InvalidRequest("bad", code="model_not_found", param="model"), 400, "model_not_found", "model"),
    (RequestRejected("empty prompt"), 400, "invalid_value", None),
    (PromptTooLong("too long"), 400, "context_length_exceeded", None),
    (EngineDead("stopped"), 503, "engine_unavailable", None),
])
def test_typed_errors_keep_their_status_code_and_message(error, status, code, param):
    api = from_exception(error)
    assert (api.status, api.code, api.param, api.message) == (status, code, param, str(error))


@pytest.mark.parametrize("error", [ValueError("internal detail"), KeyError("internal detail")])
def test_anything_else_is_a_500_with_a_logged_traceback(error, caplog):
    try:
        raise error
    except Exception as e:
        raised = e
    with caplog.at_level(logging.ERROR, logger="blockserve.server"):
        api = from_exception(raised)
    assert (api.status, api.code, api.type, api.message) == (500, "internal_error", "server_error",
                                                             "internal server error")
    assert caplog.records[-1].exc_info[1] is raised  # the traceback is in the log, not in the answer


# -- through the app --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return load_model(str(path), BACKENDS["exact"])


async def call(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
    """(status, JSON body or None)."""
    status, _, raw = await asgi_request(app, method, path, body)
    return status, json.loads(raw) if raw else None


def serve(model, body):
    """Run `body(app, engine)` with the app's lifespan (the engine thread) around it."""
    return serve_app(model, ARGS, body)


def completion(prompt: list[int], max_tokens: int = 2) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def test_an_unexpected_error_in_the_engine_is_a_500_and_others_are_still_served(model, caplog):
    async def body(app, engine):
        add = engine.add_request

        def broken(request_id, prompt, *args, **kwargs):
            if prompt == [9, 9, 9]:
                raise ValueError("internal detail")  # a bug, not the caller's input
            return add(request_id, prompt, *args, **kwargs)

        engine.add_request = broken
        with caplog.at_level(logging.ERROR, logger="blockserve.server"):
            status, error = await call(app, "POST", "/v1/completions", completion([9, 9, 9]))
        assert status == 500 and error["error"]["code"] == "internal_error", error
        assert "internal detail" not in json.dumps(error)
        assert any(r.exc_info and "internal detail" in str(r.exc_info[1]) for r in caplog.records)
        too_long = await call(app, "POST", "/v1/completions", completion(list(range(70))))
        assert too_long[0] == 400 and too_long[1]["error"]["code"] == "context_length_exceeded", too_long
        assert "maximum length of 64" in too_long[1]["error"]["message"]
        bad_ids = await call(app, "POST", "/v1/completions", completion([1, 10**6]))
        assert bad_ids[0] == 400 and bad_ids[1]["error"]["code"] == "invalid_value", bad_ids
        status, ok = await call(app, "POST", "/v1/completions", completion([1, 2, 3]))
        assert status == 200 and ok["usage"]["completion_tokens"] == 2, ok
        stats = await app.state.async_engine.call(engine.stats)  # on the engine thread, which owns it
        assert stats.kv_usage == [0.0] and stats.num_running == stats.num_waiting == 0  # nothing left behind

    serve(model, body)


def test_a_dead_engine_is_a_503(model):
    async def body(app, engine):
        def boom():
            raise RuntimeError("simulated kernel failure")

        engine.step = boom
        status, error = await call(app, "POST", "/v1/completions", completion([1, 2, 3]))
        assert status == 503 and error["error"]["code"] == "engine_unavailable", error
        assert "simulated kernel failure" in error["error"]["message"]
        assert (await call(app, "GET", "/health"))[0] == 503
        status, error = await call(app, "POST", "/reset_prefix_cache")
        assert status == 503 and error["error"]["code"] == "engine_unavailable", error

    serve(model, body)
