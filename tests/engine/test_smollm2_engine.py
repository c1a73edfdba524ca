"""The real default model through LLM.generate against transformers: 18 chat prompts of mixed
length as one batch, greedy, fp32, in the engine scenarios (tests/scenarios.py).

Tokens must be equal (`assert_greedy_parity` allowing no near-tie). None occurs in any scenario:
the reference's smallest top-2 gap over these 288 steps is 3.6e-3 nats, ~250x the largest
difference between the engine's and transformers' log-probabilities measured (1.4e-5).
"""

from __future__ import annotations

import pytest
import torch

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from tests.parity import assert_greedy_parity
from tests.scenarios import ENGINE_SCENARIOS, engine_options

pytestmark = pytest.mark.slow  # the real model through the engine against transformers, ~2 minutes

NEW_TOKENS = 16
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in at most three sentences."}
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Write a haiku about autumn leaves falling into a quiet river.",
    "What is 17 times 23? Show the steps.",
    "Explain what a hash function is to a ten-year-old.",
    "List the planets of the solar system in order from the sun.",
    "Give me a short recipe for pancakes with the quantities for two people.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the main differences between a list and a tuple in Python? Give an example of when you would "
    "use each, and mention mutability, hashing and performance.",
    "I am planning a three-day trip to Rome in October. I like museums, long walks and good coffee, but I do "
    "not like crowds. Suggest a plan for each day, with one museum, one walk and one place to eat, and tell "
    "me which sights to visit early in the morning to avoid the queues.",
    "Here is a paragraph: 'The committee met on Tuesday to discuss the budget for the coming year. After a "
    "long debate, they agreed to increase spending on public parks by ten percent, to reduce the budget for "
    "road repairs, and to postpone the decision on the new library until the spring.' Rewrite it as a "
    "bulleted list of decisions.",
]


def conversations() -> list[list[dict]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    chats += [[SYSTEM, {"role": "user", "content": q}] for q in QUESTIONS[1:5]]  # a shared cached prefix
    return chats


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, BACKENDS["exact"])


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    return [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in conversations()]


@pytest.fixture(scope="module")
def reference(smollm2_transformers, prompts):
    """Per prompt: greedy tokens, and per step the log-softmax of transformers' logits.
    One left-padded batch (padding is masked out)."""
    width = max(map(len, prompts))
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        result = smollm2_transformers.generate(
            input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    return [(result.sequences[i, width:].tolist(), [step[i].log_softmax(-1) for step in result.logits])
            for i in range(len(prompts))]


SMALL_CACHE = dict(max_model_len=512, kv_cache_memory="24MiB")  # 34 blocks; the batch needs ~100


@pytest.mark.parametrize("scenario", ENGINE_SCENARIOS)
def test_generate_matches_transformers(loaded, prompts, reference, scenario):
    llm = LLM(loaded, check_integrity=True, **engine_options(scenario, chunk_budget=64, preemption=SMALL_CACHE))
    # logprobs: greedy steps that also rank the top 5, in every scenario
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    runs = 2 if scenario == "prefix-caching" else 1  # the second pass is served from the prefix cache
    for _ in range(runs):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_greedy_parity([o.outputs[0].token_ids for o in outputs], reference)
    scheduler = llm.engine.core.scheduler
    if scenario == "prefix-caching":
        assert sum(o.num_cached_tokens for o in outputs) > 0
    if scenario == "preemption":
        assert scheduler.num_preemptions > 0
    scheduler.assert_idle()


def test_stop_strings_and_seeded_sampling(loaded, prompts):
    """Stop strings never appear in the text; a seeded request samples the same tokens alone
    and inside a batch of other (seeded and unseeded) requests."""
    llm = LLM(loaded)
    greedy = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert "Paris" in greedy.text
    stopped = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=12, stop=["Paris"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    assert "Paris" not in stopped.text and greedy.text.startswith(stopped.text)

    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm.generate(prompts[3], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = [SamplingParams(temperature=0.8, max_tokens=12), seeded, SamplingParams(temperature=1.0, seed=7, max_tokens=5)]
    in_batch = llm.generate([prompts[0], prompts[3], prompts[5]], mixed, use_tqdm=False)[1].outputs[0].token_ids
    assert in_batch == alone
    other_seed = llm.generate(prompts[3], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_samples_share_the_prompt_blocks(loaded, prompts):
    llm = LLM(loaded)
    output = llm.generate(prompts[12], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # different seeds, different samples
    kv = llm.engine.core.kv
    # Samples 1 and 2 were admitted after sample 0 computed the prompt, so they hit its full blocks.
    assert kv.prefix_cache_stats().hits == 2 * ((len(prompts[12]) - 1) // 16) * 16
