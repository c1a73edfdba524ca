"""A fault inside one engine step (the model raising, as a kernel error would), injected by
wrapping the runner's model, on a tiny random Llama:

(a) the requests of that step get a 500 in OpenAI's shape (a stream: an error event, then
    [DONE]) and the traceback is logged; a request not in that step, and the next one, succeed;
    no block is leaked;
(b) a fault that also unbalances the KV books (`check_integrity()` fails) stops the engine: the
    step's requests get their 500, everything after a 503 (/health included), never a hang;
(c) the offline LLM raises StepFailed, its cause chained, and serves the next call (or, broken,
    refuses it with EngineDead)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.llm_engine import LLMEngine, StepFailed
from blockserve.errors import EngineDead
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.server.asgi import serve_app, sse_events
from tests.server.test_async_engine import ARGS, SIZES
from tests.server.test_async_engine import assert_idle as assert_engine_idle
from tests.server.test_backpressure import assert_idle, call, metrics
from tests.server.test_deadlines import error_of

BODY = {"prompt": [5, 6, 7], "max_tokens": 12, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return load_model(str(path), BACKENDS["exact"])


class FaultyModel:
    """The runner's model, except that once `arm()`ed its next forward raises (after `corrupt()`,
    if given: a fault that also breaks the engine's books)."""

    def __init__(self, model, corrupt=None):
        self.model, self.corrupt = model, corrupt
        self.armed = self.failed = self.slow = False

    def arm(self) -> None:
        self.armed = True

    def __call__(self, *args, **kwargs):
        if self.armed:
            self.armed, self.failed = False, True
            if self.corrupt is not None:
                self.corrupt()
            raise RuntimeError("simulated kernel failure")
        if self.slow:
            time.sleep(0.02)
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def faulty(engine: LLMEngine, corrupt=None) -> FaultyModel:
    runner = engine.core.runner
    runner.model = FaultyModel(runner.model, corrupt)
    return runner.model


def unbalance_books(engine: LLMEngine):
    def corrupt():
        engine.core.kv.coordinator.pools[0].blocks[-1].ref_cnt += 1  # a free block that nobody holds
    return corrupt


def serve(model, body, **engine_args):
    return serve_app(model, {**ARGS, **engine_args},
                     lambda app, engine: asyncio.wait_for(body(app, engine), 60))  # never a hang


async def started(app, body: dict) -> asyncio.Future:
    """Send `body`; return once the engine produced its first token (so it runs in the next step)."""
    before = (await metrics(app)).get("blockserve_generation_tokens_total", 0)
    task = asyncio.ensure_future(call(app, "POST", "/v1/completions", body))
    while (await metrics(app)).get("blockserve_generation_tokens_total", 0) == before:
        await asyncio.sleep(0.005)
    return task


def test_a_failed_step_fails_its_requests_with_500_and_the_engine_serves_on(model, caplog):
    caplog.set_level(logging.ERROR, logger="blockserve.server")

    async def body(app, engine):
        fault = faulty(engine)
        long = {**BODY, "max_tokens": 60}
        fault.slow = True  # each step takes a while, so the queue fills before this one can finish
        in_step = await started(app, long)
        waiting = asyncio.ensure_future(call(app, "POST", "/v1/completions", BODY))  # max_num_seqs=1: not in the step
        streamed = asyncio.ensure_future(call(app, "POST", "/v1/completions", {**BODY, "stream": True}))
        while (await metrics(app)).get("blockserve_num_requests_waiting", 0) < 2:  # both queued behind it
            await asyncio.sleep(0.005)
        fault.slow = False
        fault.arm()
        status, _, raw = await in_step
        error = error_of(raw)
        assert status == 500 and error["code"] == "engine_step_failed" and error["type"] == "server_error", raw
        assert "retry" in error["message"] and "simulated" not in error["message"]  # nothing internal is sent
        assert fault.failed
        status, _, raw = await waiting
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == BODY["max_tokens"]
        status, _, raw = await streamed
        events = sse_events(raw)
        assert status == 200 and events[-1] == "[DONE]" and "error" not in events[-2], events[-2:]
        m = await assert_idle(app, engine)  # nothing leaked
        assert m["blockserve_request_finished_total{finished_reason=error}"] == 1
        assert (await call(app, "GET", "/health"))[0] == 200
        assert (await call(app, "POST", "/v1/completions", BODY))[0] == 200
        await assert_engine_idle(app.state.async_engine)  # C2: nothing held or pending

    serve(model, body, max_num_seqs=1)
    logged = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert logged and logged[0].exc_info and "simulated kernel failure" in str(logged[0].exc_info[1])


def test_a_failed_step_ends_a_stream_in_an_error_event(model):
    async def body(app, engine):
        fault = faulty(engine)
        stream = asyncio.ensure_future(call(app, "POST", "/v1/completions",
                                            {**BODY, "max_tokens": 40, "stream": True, "logprobs": 0}))
        while not (await metrics(app)).get("blockserve_generation_tokens_total", 0):
            await asyncio.sleep(0.005)
        fault.arm()
        status, _, raw = await stream
        events = sse_events(raw)
        assert status == 200 and events[-1] == "[DONE]", events[-2:]
        assert events[-2]["error"]["code"] == "engine_step_failed", events[-2]
        await assert_idle(app, engine)
        assert (await call(app, "POST", "/v1/completions", BODY))[0] == 200

    serve(model, body)


def test_a_fault_that_breaks_the_books_stops_the_engine_and_later_requests_get_503(model, caplog):
    caplog.set_level(logging.ERROR, logger="blockserve.server")

    async def body(app, engine):
        fault = faulty(engine, unbalance_books(engine))
        in_step = await started(app, {**BODY, "max_tokens": 40})
        fault.arm()
        status, _, raw = await in_step
        assert status == 500 and error_of(raw)["code"] == "engine_step_failed", raw
        while app.state.async_engine.is_alive:
            await asyncio.sleep(0.01)
        for method, path, request in (("GET", "/health", None), ("POST", "/v1/completions", BODY)):
            status, _, raw = await call(app, method, path, request)
            error = error_of(raw)
            assert status == 503 and error["code"] == "engine_unavailable", raw
        assert "books no longer balance" in error["message"]

    serve(model, body)
    assert any("engine is stopping" in r.getMessage() for r in caplog.records)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_the_offline_llm_raises_the_step_failure_and_serves_the_next_call(model):
    llm = LLM(model, **ARGS)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    fault = faulty(llm.engine)
    fault.arm()
    with pytest.raises(StepFailed, match="simulated kernel failure") as caught:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert isinstance(caught.value.__cause__, RuntimeError) and caught.value.engine_intact
    assert len(caught.value.request_ids) == len(PROMPTS)  # all three were in the failed step
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    llm.engine.step()  # hand the last finished ids to the worker
    llm.engine.core.scheduler.assert_idle()


def test_the_offline_llm_refuses_to_go_on_once_its_books_are_broken(model):
    llm = LLM(model, **ARGS)
    fault = faulty(llm.engine, unbalance_books(llm.engine))
    fault.arm()
    with pytest.raises(StepFailed, match="books no longer balance") as caught:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not caught.value.engine_intact
    with pytest.raises(EngineDead, match="restart"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
