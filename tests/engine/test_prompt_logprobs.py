"""SamplingParams(prompt_logprobs=n) on the bundled SmolLM2 against transformers' log-softmax of
the same prompt, with chunked prefill splitting each prompt over several steps, requests with and
without prompt logprobs in one batch, and the prefix cache (which such requests must not use)."""

from __future__ import annotations

import pytest
import torch

from blockserve import LLM, SamplingParams

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.slow]  # the real model against transformers, ~50 s

PROMPTS = ["The quick brown fox jumps over the lazy dog. Then the dog wakes up and chases the fox across the "
           "field, past the old barn and into the woods",
           "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"]
TOP = 3
# Both sides compute in float32 from the same dequantized weights; what is left is summation order.
ATOL = 2e-3


@pytest.fixture(scope="module")
def llm():
    # 16 tokens a step: every prompt (25-30 tokens) is computed in two or more chunks.
    return LLM(max_model_len=256, max_num_batched_tokens=16, kv_cache_memory="16MiB", quantized_matmul=False,
               num_threads=1)


@pytest.fixture(scope="module")
def reference(llm, smollm2_transformers):
    """Per prompt: its ids, transformers' logprob of each token after the first, and the top-TOP ids."""
    tokenizer = llm.get_tokenizer()
    result = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            logprobs = torch.log_softmax(smollm2_transformers(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
            picked = logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
            result.append((ids, picked, logprobs.topk(TOP, dim=-1)))
    return result


def check(output, ids, picked, top, n):
    lps = output.prompt_logprobs
    assert output.prompt_token_ids == ids and len(lps) == len(ids) and lps[0] is None
    for position, (entry, token) in enumerate(zip(lps[1:], ids[1:])):
        assert entry[token].logprob == pytest.approx(picked[position].item(), abs=ATOL), position
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
        assert len(ranked) == n
        assert [lp.logprob for lp in ranked] == pytest.approx(top.values[position, :n].tolist(), abs=ATOL)
        assert entry[token].decoded_token is not None
        if n:
            assert ranked[0].logprob >= entry[token].logprob - 1e-6


def test_prompt_logprobs_match_transformers_over_chunks(llm, reference):
    assert all(len(ids) > 16 for ids, _, _ in reference)  # two chunks at least each
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)]
    plain = SamplingParams(temperature=0, max_tokens=2)
    outputs = llm.generate(PROMPTS + PROMPTS, params + [plain, plain], use_tqdm=False)
    for output, (ids, picked, top), n in zip(outputs, reference, (TOP, 0)):
        check(output, ids, picked, top, n)
    assert [o.prompt_logprobs for o in outputs[2:]] == [None, None]
    # Asking for prompt logprobs changes nothing else: the same tokens as without.
    assert [o.outputs[0].token_ids for o in outputs[:2]] == [o.outputs[0].token_ids for o in outputs[2:]]


def test_prompt_logprobs_skip_the_prefix_cache_and_n_computes_them_once(llm, reference):
    ids, picked, top = reference[0]
    warm = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and warm.prompt_logprobs is None  # the prompt is cached now
    output = llm.generate([ids], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=2, prompt_logprobs=1),
                          use_tqdm=False)[0]
    assert output.num_cached_tokens == 0  # computed, not served from the cache: cached tokens have no logits
    check(output, ids, picked, top, 1)
    assert len(output.outputs) == 2 and all(len(c.token_ids) == 2 for c in output.outputs)
    single = llm.generate([ids[:1]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert single.prompt_logprobs == [None]


def test_prompt_logprobs_survive_preemption(llm, reference):
    """A KV cache of 128 tokens for four requests of ~70: requests are preempted (some mid-prompt,
    with chunks of 16) and recomputed; each still gets every prompt entry, once."""
    small = LLM(llm.engine.core.loaded, max_model_len=96, max_num_batched_tokens=16, kv_cache_memory="6MiB",
                num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=TOP)
    outputs = small.generate(PROMPTS * 2, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    for output, (ids, picked, top) in zip(outputs, reference * 2):
        check(output, ids, picked, top, TOP)
    small.engine.core.scheduler.assert_idle()


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
