"""AsyncEngine on a tiny random Llama (token-id prompts, no tokenizer), in-process: streams equal the
offline results, errors stay with their request, aborts and resets run between steps, a failed
step fails everything cleanly, shutdown joins the thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.config import EngineConfig
from blockserve.engine.core import EngineCore
from blockserve.engine.llm_engine import LLMEngine
from blockserve.errors import EngineDead, PromptTooLong
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.server.engine_bridge.async_engine import AsyncEngine

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
ARGS = dict(max_model_len=64, block_size=4, num_threads=1, kv_cache_memory="4MiB")
PROMPTS = [[(7 * i + j) % 512 for j in range(5 + 3 * i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Loaded once; each test builds a fresh engine on these weights."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return load_model(str(path), BACKENDS["exact"])


@pytest.fixture(scope="module")
def expected(model):
    return [o.outputs[0].token_ids for o in LLM(model, **ARGS).generate(PROMPTS, GREEDY, use_tqdm=False)]


class Recorder:
    """The Observer: what ended how, and how many tokens were generated."""

    def __init__(self):
        self.finished: list[list[str]] = []
        self.tokens = 0
        self.rejected: list[str] = []

    def on_first_token(self, ttft, num_prompt_tokens):
        pass

    def on_tokens(self, inter_token, num_new_tokens):
        self.tokens += num_new_tokens

    def on_finished(self, e2e, finish_reasons):
        self.finished.append(finish_reasons)

    def on_rejected(self, reason):
        self.rejected.append(reason)


def run(model, body, observer=None, **options):
    """Run `body(async_engine)` on a fresh engine's loop (EngineConfig `options` added to ARGS); always
    shut the engine down."""

    async def main():
        config = EngineConfig(model=model.source, **ARGS, **options)
        engine = AsyncEngine(LLMEngine(config, EngineCore(config, model)), observer)
        engine.start()
        try:
            return await body(engine)
        finally:
            engine.shutdown()
            assert not engine.is_alive

    threads = threading.active_count()
    result = asyncio.run(main())
    assert threading.active_count() == threads  # the engine thread is gone
    return result


async def final(stream):
    last = None
    async for last in stream:
        pass
    return last


async def assert_idle(engine):
    """On the engine thread, once the last finished ids reached the worker: nothing held or pending (C2)."""
    while await engine.call(engine.engine.has_unfinished_requests):
        await asyncio.sleep(0.01)
    await engine.call(engine.engine.core.scheduler.assert_idle)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_concurrent_streams_equal_offline(model, expected, async_scheduling):
    async def body(engine):
        streams = [await engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        outputs = await asyncio.gather(*(final(s) for s in streams))
        await assert_idle(engine)
        return [o.outputs[0].token_ids for o in outputs], [o.finished for o in outputs]

    tokens, finished = run(model, body, async_scheduling=async_scheduling)
    assert tokens == expected and all(finished)


def test_a_rejected_request_fails_alone(model, expected):
    async def body(engine):
        good = await engine.add_request("good", PROMPTS[3], GREEDY)
        with pytest.raises(PromptTooLong):
            await engine.add_request("long", list(range(70)), GREEDY)
        with pytest.raises(ValueError, match="token ids"):
            await engine.add_request("bad", [1, 2, 10**6], GREEDY)
        with pytest.raises(ValueError, match="no tokenizer"):
            await engine.add_request("text", "hello", GREEDY)
        output = await final(good)
        await assert_idle(engine)
        return output.outputs[0].token_ids

    assert run(model, body) == expected[3]


LONG = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)  # PROMPTS[1] + 50 tokens fill max_model_len


def held(engine):
    """(release, task): the engine thread waits in a call until `release.set()`; no step runs meanwhile."""
    release = threading.Event()
    return release, asyncio.ensure_future(engine.call(release.wait))


async def nothing_left(engine) -> bool:
    """Read on the engine thread right after what is queued before it: no request running or
    waiting, no block held (the finished id may still be on its way to the worker: see assert_idle)."""
    stats = await engine.call(engine.engine.stats)
    return stats.num_running == stats.num_waiting == 0 and stats.kv_usage == [0.0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_close_aborts_and_frees_blocks_before_the_next_step(model, async_scheduling):
    recorder = Recorder()

    async def body(engine):
        stream = await engine.add_request("long", PROMPTS[1], LONG)
        await stream.__anext__()
        ok, reason = await engine.reset_prefix_cache()
        assert not ok and "in use" in reason  # the request holds blocks: refused, with the reason
        release, hold = held(engine)
        await asyncio.sleep(0)  # the hold is queued
        stream.close()  # its abort is queued behind the hold: no step runs between the two
        release.set()
        await hold
        assert await nothing_left(engine)  # runs right after the abort
        assert recorder.finished == [["abort"]] and recorder.tokens < LONG.max_tokens
        assert await engine.reset_prefix_cache() == (True, "")
        await assert_idle(engine)

    run(model, body, recorder, async_scheduling=async_scheduling)


def test_a_failed_step_fails_every_stream_and_later_requests(model):
    async def body(engine):
        stream = await engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))

        def boom():
            raise RuntimeError("simulated kernel failure")

        engine.engine.step = boom  # the next step fails
        with pytest.raises(EngineDead, match="simulated kernel failure"):
            await final(stream)
        assert not engine.is_alive
        with pytest.raises(EngineDead):
            await engine.add_request("later", PROMPTS[0], GREEDY)

    run(model, body)


def test_cancelled_add_is_undone(model):
    """Cancelled while the engine is adding it: the add completes, then the abort takes it out
    before any step, so it never produces a token and holds no block."""
    recorder = Recorder()

    async def body(engine):
        adding, proceed = threading.Event(), threading.Event()

        def prompt():  # runs on the engine thread, inside the add
            adding.set()
            proceed.wait()
            return PROMPTS[1]

        task = asyncio.ensure_future(engine.add_request("gone", prompt, LONG))
        await asyncio.to_thread(adding.wait)
        release, hold = held(engine)  # queued behind the add: the engine thread waits there after adding
        await asyncio.sleep(0)
        task.cancel()
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task  # its abort is queued before the hold is released
        release.set()
        await hold
        assert await nothing_left(engine)
        assert recorder.finished == [["abort"]] and recorder.tokens == 0
        await assert_idle(engine)

    run(model, body, recorder)


def test_add_cancelled_before_the_engine_took_it_is_never_added(model):
    recorder = Recorder()

    async def body(engine):
        release, hold = held(engine)
        await asyncio.sleep(0)
        task = asyncio.ensure_future(engine.add_request("gone", PROMPTS[1], LONG))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await hold
        assert await nothing_left(engine)
        assert recorder.finished == [] and recorder.tokens == 0  # nothing was added, so nothing to abort
        await assert_idle(engine)

    run(model, body, recorder)
