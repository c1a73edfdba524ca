"""C7 through the offline API: bad input gets an error naming the problem and what to do, and
the engine keeps serving with nothing leaked."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.models.random_checkpoint import save_random_model
from tests.engine.test_tiny_engine import SIZES


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return LLM(str(path), block_size=4, max_model_len=64, kv_cache_memory="1MiB")


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(llm):
    good = SamplingParams(temperature=0, max_tokens=4)
    before = llm.generate([[1, 2, 3]], good, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"prompt \(70 tokens\) plus max_tokens \(4\) is 74 tokens, over the model's maximum length of 64"):
        llm.generate([[1] * 70], good, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 512\)"):
        llm.generate([[1, 600]], good, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("a text prompt", good, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop_token_ids token ids must be in \[0, 512\); got \[600\]"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[5, 600], min_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate([[1], [2]], [good], use_tqdm=False)
    # A batch with one bad prompt is rejected whole, and leaves nothing queued or held.
    with pytest.raises(ValueError, match="over the model's maximum length"):
        llm.generate([[1, 2, 3], [1] * 70], good, use_tqdm=False)
    scheduler = llm.engine.core.scheduler
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    scheduler.assert_idle()
    assert llm.generate([[1, 2, 3]], good, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature must be non-negative"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(n=0), "n must be at least 1"),
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(min_tokens=5, max_tokens=2), r"min_tokens \(5\) must not exceed max_tokens \(2\)"),
    (dict(logprobs=50), r"logprobs must be in \[0, 20\]"),
])
def test_invalid_sampling_params_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_engine_arguments_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="valid engine arguments are"):
        LLM(None, not_an_option=1)
    with pytest.raises(ValueError, match="unknown attention_backend"):
        LLM(None, attention_backend="flash")
    with pytest.raises(ValueError, match="cannot read kv_cache_memory"):
        LLM(None, kv_cache_memory="lots")


def test_an_engine_that_fails_after_its_core_is_built_stops_that_core(llm, monkeypatch):
    """LLMEngine builds its core, then its grammar compiler: a failure there closes the core it
    built (its tensor-parallel ranks, if any), and leaves a core it was given to its owner."""
    from blockserve.engine import core as core_module
    from blockserve.engine import llm_engine

    closed = []
    monkeypatch.setattr(core_module.EngineCore, "close", lambda self: closed.append(self))

    def broken(*args):
        raise RuntimeError("grammar compiler failed")

    monkeypatch.setattr(llm_engine, "GrammarCompiler", broken)
    with pytest.raises(RuntimeError, match="grammar compiler failed"):
        llm_engine.LLMEngine(llm.engine.config)
    assert len(closed) == 1 and closed[0] is not llm.engine.core
    with pytest.raises(RuntimeError, match="grammar compiler failed"):
        llm_engine.LLMEngine(llm.engine.config, llm.engine.core)
    assert len(closed) == 1  # the given core is not ours to stop
