"""The second prefix-cache tier through the engine, on a tiny random Llama: a long shared history
larger than the device pool is served from disk (and host memory) with the greedy output of an
engine without tiers; a restart finds it; another model or salt does not; bad settings are refused.
And on a tiny hybrid (Qwen3-Next: Gated DeltaNet + attention), whose state checkpoints go through
the disk tier with its attention blocks."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
from transformers import Gemma2Config, LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.engine.config import EngineConfig
from blockserve.models.random_checkpoint import save_random_model
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.step_costs import FlatStepCosts
from tests.models.conftest import tiny_model  # noqa: F401 (a fixture)

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
# A 4-token block holds 2 layers x (K, V) x 2 heads x 16 x 4 bytes = 2 KiB: 47 blocks hold 188 tokens, about one
# history, so the second history evicts the first.
ENGINE = dict(block_size=4, max_model_len=160, kv_cache_memory=48 * 2048, check_integrity=True, poison=True)
HISTORIES = [[(37 * i + 11 * h) % 500 + 1 for i in range(140)] for h in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_random_model(LlamaConfig(**SIZES), path)
    return str(path)


def ask(llm: LLM, prompts, salt: str | None = None, params: SamplingParams = GREEDY):
    engine = llm.engine
    outputs = []
    for prompt in prompts:
        engine.add_request(uuid.uuid4().hex, prompt, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            outputs.extend(o for o in engine.step() if o.finished)
        if engine.core.kv_offload is not None:
            engine.core.kv_offload.flush()  # saves are written off the step: let them land before the next turn
    if params.logprobs is not None:  # with each sampled token's logprob
        return [(o.outputs[0].token_ids, o.num_cached_tokens,
                 [step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]) for o in outputs]
    return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outputs]


def held_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory)
               for name in names if name.endswith(".kv"))


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("blockserve-kv-writer", "blockserve-kv-loader")]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_histories_beyond_the_device_pool_come_back_from_disk_and_after_a_restart(llama, tmp_path, async_scheduling):
    turns = [h + [7, 8, 9] for h in HISTORIES] + [h + [10, 11] for h in HISTORIES]
    with LLM(llama, **ENGINE) as plain:
        expected = [tokens for tokens, _ in ask(plain, turns)]
        assert plain.engine.stats().prefix_cache_hits == 0  # each history was evicted before it came back
    directory = str(tmp_path / "kv")
    with LLM(llama, kv_offload_dir=directory, kv_offload_memory="64KiB", async_scheduling=async_scheduling,
             **ENGINE) as llm:
        answers = ask(llm, turns)
        stats = llm.engine.stats()
    assert [tokens for tokens, _ in answers] == expected
    assert [cached for _, cached in answers[3:]] == [140, 140, 140]  # 35 whole blocks, from the tiers
    assert stats.prefix_cache_tier_hits == 3 * 140
    tiers = {t.name: t for t in stats.kv_offload.tiers}
    assert tiers["memory"].bytes_held <= 64 * 1024 and tiers["disk"].hits > 0
    assert tiers["disk"].bytes_loaded == 2048 * tiers["disk"].hits and tiers["disk"].load_seconds > 0
    assert not writer_threads()

    with LLM(llama, kv_offload_dir=directory, **ENGINE) as restarted:
        again = ask(restarted, turns[:3])
    assert again == [(expected[i], 140) for i in range(3)]
    assert not [n for _, _, names in os.walk(directory) for n in names if n.endswith(".tmp")]


def test_a_host_memory_tier_alone_serves_histories_beyond_the_device_pool(llama):
    """The host-memory tier by itself (as under a GPU's device pool; here on the CPU, where its entries are
    ordinary host memory, as everywhere): hits answer as an engine without tiers, and closing joins its
    threads."""
    turns = [h + [7, 8, 9] for h in HISTORIES] + [h + [10, 11] for h in HISTORIES]
    with LLM(llama, **ENGINE) as plain:
        expected = [tokens for tokens, _ in ask(plain, turns)]
    with LLM(llama, kv_offload_memory="1MiB", **ENGINE) as llm:
        answers = ask(llm, turns)
        stats = llm.engine.stats().kv_offload
    assert [tokens for tokens, _ in answers] == expected
    assert [cached for _, cached in answers[3:]] == [140, 140, 140]
    (memory,) = stats.tiers
    assert memory.name == "memory" and memory.hits == 3 * 35 and memory.load_failures == 0
    assert memory.writes == memory.entries > 3 * 35 and memory.bytes_held == 2048 * memory.entries
    assert stats.queued_bytes == 0 and stats.writes_dropped == 0 and not writer_threads()


def test_a_tier_hit_is_read_while_running_requests_decode(llama, tmp_path):
    """A request arriving while another decodes waits while its blocks are read on the loader thread
    (the decode goes on), then loads them: the same answers as alone, and as without tiers."""
    other, history = [5, 6, 7, 8], HISTORIES[0] + [7, 8, 9]
    long = SamplingParams(temperature=0, max_tokens=12)
    with LLM(llama, **ENGINE) as plain:
        expected = ask(plain, [history])[0][0], ask(plain, [other], params=long)[0][0]
    directory = str(tmp_path / "kv")
    with LLM(llama, kv_offload_dir=directory, **ENGINE) as llm:
        ask(llm, [history])
    with LLM(llama, kv_offload_dir=directory, **ENGINE) as restarted:
        engine, outputs = restarted.engine, {}
        engine.add_request("decoding", other, long)
        engine.step()
        engine.add_request("from disk", history, GREEDY)
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        external = engine.core.kv.external
        assert external.num_load_waits >= 1 and not external.waiting_requests()
        assert restarted.engine.stats().kv_offload.tiers[0].hits == 35
    assert (outputs["from disk"].outputs[0].token_ids, outputs["from disk"].num_cached_tokens) == (expected[0], 140)
    assert outputs["decoding"].outputs[0].token_ids == expected[1]


def test_another_model_or_salt_gets_no_hit(llama, tmp_path_factory, tmp_path):
    directory = str(tmp_path / "kv")
    with LLM(llama, kv_offload_dir=directory, **ENGINE) as llm:
        ask(llm, HISTORIES[:1])
        assert ask(llm, HISTORIES[:1], salt="tenant")[0][1] == 0
    other = tmp_path_factory.mktemp("other")
    save_random_model(LlamaConfig(**SIZES), other, seed=1)
    with LLM(str(other), kv_offload_dir=directory, **ENGINE) as llm:
        assert ask(llm, HISTORIES[:1])[0][1] == 0
        assert llm.engine.stats().kv_offload.tiers[0].hits == 0


def test_bad_tier_settings_are_refused(llama, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot be used"):
        LLM(llama, kv_offload_dir=str(blocker / "kv"), **ENGINE)
    assert not writer_threads()
    for bad, match in ((dict(kv_offload_size="lots"), "kv_offload_size"),
                       (dict(kv_offload_queue="0MiB"), "kv_offload_queue"),
                       (dict(kv_offload_memory="0GiB"), "kv_offload_memory"),
                       (dict(kv_offload_dir="d", enable_prefix_caching=False), "need prefix caching"),
                       (dict(kv_offload_memory="1GiB", tensor_parallel_size=2), "use kv_offload_dir")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="kv_offload_queue.*smaller than one block"):
        LLM(llama, kv_offload_dir=str(tmp_path / "kv"), kv_offload_queue="1KiB", **ENGINE)
    assert not writer_threads()


def test_a_sliding_window_model_loads_only_its_window_and_answers_as_without_tiers(tmp_path):
    """Gemma 2 alternates sliding-window (8 tokens) and global layers: a tier hit loads every global
    block but only the window's blocks of the sliding layers (2 of 4 tokens), with the tokens and
    logprobs of an engine without tiers, on and after a restart."""
    gemma = tmp_path / "gemma2"
    save_random_model(Gemma2Config(**SIZES, head_dim=16, sliding_window=8), gemma)
    turns = [h + [7, 8, 9] for h in HISTORIES] + [h + [10, 11] for h in HISTORIES]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)

    def same(answers, expected, cached):
        for (tokens, got_cached, logprobs), (want, _, want_logprobs), c in zip(answers, expected, cached, strict=True):
            assert tokens == want and got_cached == c
            assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4

    with LLM(str(gemma), **ENGINE) as plain:
        expected = ask(plain, turns, params=params)
        assert plain.engine.stats().prefix_cache_hits == 0
    directory = str(tmp_path / "kv")
    with LLM(str(gemma), kv_offload_dir=directory, **ENGINE) as llm:
        same(ask(llm, turns, params=params), expected, [0, 0, 0, 140, 140, 140])
        stats = llm.engine.stats()
    # Per hit: 35 global blocks and the 2 sliding-window blocks before the run's end.
    assert stats.kv_offload.tiers[0].hits == 3 * (35 + 2)
    # Every block of both groups is saved: 37 full ones per history (148 tokens written), then each second
    # turn's own block 35.
    assert stats.kv_offload.tiers[0].entries == 2 * (3 * 37 + 3)
    with LLM(str(gemma), kv_offload_dir=directory, **ENGINE) as restarted:
        same(ask(restarted, turns[:3], params=params), expected[:3], [140, 140, 140])


@pytest.mark.slow  # three engines on a hybrid: ~10 s
def test_a_hybrid_resumes_from_a_state_checkpoint_on_disk(tiny_model, tmp_path):
    path, _ = tiny_model("qwen3_next")  # checkpoint stride 64
    history = [(13 * i) % 500 + 1 for i in range(150)]
    turns = [history + [5, 6, 7], history + [8, 9]]
    engine = dict(block_size=4, max_model_len=192, check_integrity=True, poison=True)
    with LLM(str(path), **engine) as plain:
        expected = [tokens for tokens, _ in ask(plain, turns[:1])] + [tokens for tokens, _ in ask(plain, turns[1:])]
    directory = str(tmp_path / "kv")
    with LLM(str(path), kv_offload_dir=directory, **engine) as llm:
        assert ask(llm, turns[:1])[0] == (expected[0], 0)
    with LLM(str(path), kv_offload_dir=directory, **engine) as restarted:
        assert ask(restarted, turns[1:]) == [(expected[1], 128)]  # two strides: blocks and the state after them
        stats = restarted.engine.stats()
    assert stats.prefix_cache_tier_hits == 128
    assert stats.kv_offload.tiers[0].hits == 128 // 4 + 1  # the attention blocks, and the state group's checkpoint


def test_two_engines_share_a_directory_and_a_tiny_cap_only_limits_hits(llama, tmp_path):
    directory = str(tmp_path / "kv")
    turns = [h + [7, 8, 9] for h in HISTORIES[:2]]
    with LLM(llama, **ENGINE) as plain:
        expected = [tokens for tokens, _ in ask(plain, turns)]
    with LLM(llama, kv_offload_dir=directory, **ENGINE) as a, LLM(llama, kv_offload_dir=directory, **ENGINE) as b:
        assert ask(a, turns[:1]) == [(expected[0], 0)]
        assert ask(b, turns[:1]) == [(expected[0], 140)]  # a's entries, read by b
        assert ask(b, turns[1:]) == [(expected[1], 0)]
        assert ask(a, turns[1:]) == [(expected[1], 140)]  # and b's by a
    # One cap for the directory, not one per engine: a history's 35 entries take 72 KiB, two would pass 100 KiB.
    shared = dict(kv_offload_dir=str(tmp_path / "shared"), kv_offload_size="100KiB", **ENGINE)
    with LLM(llama, **shared) as a, LLM(llama, **shared) as b:
        assert ask(a, turns[:1]) == [(expected[0], 0)] and ask(b, turns[1:]) == [(expected[1], 0)]
        held = held_bytes(tmp_path / "shared")
        assert 72 * 1024 < held <= 100 * 1024
        assert a.engine.stats().kv_offload.tiers[0].bytes_held == held  # every engine reports the directory
        assert [tokens for tokens, _ in ask(a, turns)] == expected  # partly evicted: still the same answers
    # Different caps: the directory keeps to the smallest of the engines using it, while they run.
    mixed = tmp_path / "mixed"
    with LLM(llama, kv_offload_dir=str(mixed), kv_offload_size="100KiB", **ENGINE) as a:
        with LLM(llama, kv_offload_dir=str(mixed), kv_offload_size="40KiB", **ENGINE) as b:
            assert ask(a, turns[:1]) == [(expected[0], 0)]
            assert held_bytes(mixed) <= 40 * 1024
            assert [tokens for tokens, _ in ask(b, turns[:1])] == expected[:1]
        assert ask(a, turns[1:]) == [(expected[1], 0)]
        assert 72 * 1024 < held_bytes(mixed) <= 100 * 1024  # b has closed: a's cap
    assert os.listdir(mixed / ".engines") == []
    with LLM(llama, kv_offload_dir=str(tmp_path / "small"), kv_offload_size="5KiB", **ENGINE) as small:
        answers = ask(small, turns + turns)
        tier = small.engine.stats().kv_offload.tiers[0]
    assert [tokens for tokens, _ in answers] == expected + expected
    assert tier.bytes_held <= 5 * 1024 and tier.entries == 2


def test_a_draft_model_s_blocks_follow_a_tier_hit(llama, tmp_path, monkeypatch):
    """A tier loads the target's KV only: the draft's groups get blocks for the same positions, with the
    target's, and the draft feeds them at its first proposal; the answers stay those without either."""
    monkeypatch.setattr(speculator_module, "StepCosts", FlatStepCosts)  # every draft verified
    turns = [h + [7, 8, 9] for h in HISTORIES]
    with LLM(llama, **ENGINE) as plain:
        expected = [tokens for tokens, _ in ask(plain, turns)]
    both = ENGINE | dict(kv_cache_memory=2 * ENGINE["kv_cache_memory"])  # the draft's cache from the same budget
    directory = str(tmp_path / "kv")
    with LLM(llama, kv_offload_dir=directory, **both) as llm:
        ask(llm, turns)
    draft = {"method": "draft_model", "model": llama, "num_speculative_tokens": 3}
    with LLM(llama, kv_offload_dir=directory, speculative_config=draft, **both) as restarted:
        again = ask(restarted, turns)
        stats = restarted.engine.stats()
        restarted.engine.core.scheduler.assert_idle()
    assert again == [(tokens, 140) for tokens in expected]
    assert stats.prefix_cache_tier_hits == 3 * 140
    assert stats.speculation.num_accepted_tokens > 0  # the draft is the target: its drafts match
