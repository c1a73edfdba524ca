"""Async scheduling (engine/core.py): each step is scheduled and launched before the previous one's
tokens are back, its in-flight input ids taken from those samples on the device. On the CPU the
forward runs inside the launch, so nothing overlaps, but the bookkeeping is the GPU's: the same
outputs as one step at a time, for every layer kind, under prefix caching, chunked prefill,
preemption and poison, with the KV books checked after every step and nothing held at the end.

Per request: greedy; a stop token met mid-way (its request computes one more row, dropped); two
seeded samples (n=2) with top-k/top-p; the three penalties (which read the output tokens, so the launch waits for
the step before); logprobs with min_tokens; max_tokens 1 (ended by length while in flight); prompt
logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.llm_engine import StepFailed
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.engine.test_gemma3_engine import CONFIG as GEMMA3
from tests.engine.test_hybrid_prefix_caching import slot_and_block_bytes
from tests.engine.test_tiny_engine import SIZES as LLAMA
from tests.models.conftest import VOCAB, tiny_model  # noqa: F401 a fixture
from tests.server.test_step_faults import FaultyModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
OWN_CONFIGS = {"llama": lambda: LlamaConfig(**LLAMA), "gemma3": lambda: Gemma3TextConfig(**GEMMA3)}
FAMILIES = ("llama", "gemma3", "deepseek_v3", "kimi_linear", "qwen3_next")


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tiny_model, tmp_path_factory):
    if request.param in OWN_CONFIGS:
        path = tmp_path_factory.mktemp(request.param)
        save_random_model(OWN_CONFIGS[request.param](), path)
    else:
        path, _ = tiny_model(request.param)
    return load_model(str(path), BACKENDS["exact"])


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (14,), generator=gen).tolist()
    return [(shared if i % 2 else []) + torch.randint(0, VOCAB, (3 + 4 * i,), generator=gen).tolist()
            for i in range(8)]


def mixed_params(greedy: list[list[int]]) -> list[SamplingParams]:
    """One kind of request per prompt; the stop token is the 5th of that prompt's greedy output."""
    def greedy_params(**extra):
        return SamplingParams(**{"temperature": 0, "max_tokens": 12, **extra})

    return [
        greedy_params(),
        greedy_params(stop_token_ids=[greedy[1][4]]),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=12, n=2),
        greedy_params(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        greedy_params(logprobs=3, min_tokens=6, stop_token_ids=[greedy[4][1]]),
        greedy_params(max_tokens=1),
        SamplingParams(temperature=1.0, seed=11, max_tokens=10, presence_penalty=0.2, prompt_logprobs=2),
        greedy_params(stop_token_ids=[greedy[7][0]]),
    ]


def small_cache(model) -> dict:
    """Engine arguments whose cache holds one long request but not the batch (so it preempts), with
    prefix caching (state checkpoints on hybrid models), a 16-token step budget, poison and checks."""
    slot, block = slot_and_block_bytes(model)
    max_num_seqs, checkpoints = 8, 6
    memory = (max_num_seqs + 1 + checkpoints) * slot + 30 * block + 1
    share = checkpoints * slot / memory if slot else 0.0
    return dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=16, kv_cache_memory=memory, state_checkpoint_share=share,
                enable_prefix_caching=True, poison=True, check_integrity=True)


def run(llm: LLM, params):
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    core = llm.engine.core
    core.scheduler.assert_idle()
    assert core.runner.batch.requests == {} and not core.has_work()
    return outputs


def count_in_flight_inputs(llm: LLM) -> list[int]:
    """A list that counts, per launched step, the decode rows whose input id was still in flight."""
    runner, counts = llm.engine.core.runner, []
    launch = runner.launch

    def counted(out):
        counts.append(sum(ids[0] < 0 for ids in out.scheduled_token_ids.values()))
        return launch(out)

    runner.launch = counted
    return counts


def test_async_scheduling_gives_the_same_outputs(loaded):
    args = small_cache(loaded.model)
    sync = LLM(loaded, **args)
    greedy = [o.outputs[0].token_ids for o in run(sync, SamplingParams(temperature=0, max_tokens=12))]
    params = mixed_params(greedy)
    want_requests = run(sync, params)
    want = [o.outputs[0] for o in want_requests]
    assert sync.engine.core.scheduler.num_preemptions > 0

    ahead = LLM(loaded, async_scheduling=True, **args)
    in_flight = count_in_flight_inputs(ahead)
    got_requests = run(ahead, params)
    got = [o.outputs[0] for o in got_requests]
    assert ahead.engine.core.scheduler.num_preemptions > 0
    assert sum(in_flight) > 0  # steps really were launched ahead of their inputs
    assert [[c.token_ids for c in o.outputs] for o in got_requests] == [[c.token_ids for c in o.outputs]
                                                                       for o in want_requests]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert len(want_requests[2].outputs) == 2
    assert want[1].finish_reason == "stop" and len(want[1].token_ids) == greedy[1].index(greedy[1][4]) + 1
    assert len(want[4].token_ids) >= 6 and len(want[5].token_ids) == 1
    for got_lps, want_lps in ((got[4].logprobs, want[4].logprobs),
                              (got_requests[6].prompt_logprobs[1:], want_requests[6].prompt_logprobs[1:])):
        assert len(got_lps) == len(want_lps) > 0
        for got_lp, want_lp in zip(got_lps, want_lps):
            assert got_lp.keys() == want_lp.keys()
            # float rounding only: preemption, so the prompts' chunks, fall differently one step ahead
            assert all(abs(got_lp[t].logprob - want_lp[t].logprob) < 1e-4 for t in got_lp), (got_lp, want_lp)


def test_a_failed_step_fails_both_steps_in_flight_and_the_engine_goes_on(tmp_path, caplog):
    save_random_model(LlamaConfig(**LLAMA), tmp_path)
    llm = LLM(str(tmp_path), async_scheduling=True, check_integrity=True, max_model_len=MAX_MODEL_LEN)
    assert "async scheduling on cpu: the forward runs inside the launch" in caplog.text  # the CPU user is told
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8)
    engine.add_request("first", [1, 2, 3], greedy)
    engine.step()  # first's prompt launched
    engine.add_request("second", [4, 5, 6, 7], greedy)
    model = engine.core.runner.model = FaultyModel(engine.core.runner.model)
    model.arm()
    with pytest.raises(StepFailed) as failed:
        engine.step()  # launches first's decode and second's prompt: the forward raises
    assert sorted(failed.value.request_ids) == ["first", "second"]
    assert failed.value.engine_intact
    while engine.has_unfinished_requests():
        engine.step()
    engine.core.scheduler.assert_idle()
    out = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0]
    alone = LLM(str(tmp_path), max_model_len=MAX_MODEL_LEN).generate([[1, 2, 3]], greedy, use_tqdm=False)
    assert out.token_ids == alone[0].outputs[0].token_ids and len(out.token_ids) == 8


def test_async_scheduling_is_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="async_scheduling runs on one device"):
        LLM("unused", async_scheduling=True, tensor_parallel_size=2)
