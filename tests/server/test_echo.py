"""/v1/completions `echo` (with and without logprobs, max_tokens 0, streamed) and `best_of`, in
process on the bundled SmolLM2. The prompt logprobs are compared with the offline API's
(`SamplingParams(prompt_logprobs=n)`, checked against transformers in tests/engine), on the same
weights."""

from __future__ import annotations

import pytest

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.config import EngineConfig
from blockserve.models.loader import load_model
from tests.server.asgi import post_each

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # the real model

ARGS = dict(max_model_len=256, max_num_batched_tokens=32, kv_cache_memory="16MiB", num_threads=1)
PROMPT = "The capital of France is Paris, and the capital of Spain is Madrid. The capital of Italy is"


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, BACKENDS[EngineConfig().attention_backend])


@pytest.fixture(scope="module")
def offline(loaded):
    return LLM(loaded, **ARGS)


def serve(loaded, requests):
    """POST each completions body in turn to a fresh app: [(status, answer)] (tests/server/asgi.py)."""
    return post_each(loaded, ARGS, "/v1/completions", requests)


def prompt_reference(offline, prompt, top):
    output = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top),
                              use_tqdm=False)[0]
    return output.prompt_token_ids, output.prompt_logprobs


def test_echo_logprobs_are_the_prompt_logprobs_in_openai_legacy_shape(loaded, offline):
    tokenizer = offline.get_tokenizer()
    ids, reference = prompt_reference(offline, PROMPT, 2)
    lm_eval_body = {"prompt": [ids, ids[:12]], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
                    "seed": 1234}  # what lm-eval's loglikelihood sends (token ids, batched)
    answers = serve(loaded, [
        {"prompt": PROMPT, "max_tokens": 0, "logprobs": 2, "echo": True},
        {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2, "echo": True, "temperature": 0},
        {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2, "echo": True, "temperature": 0, "stream": True},
        lm_eval_body,
        {"prompt": PROMPT, "max_tokens": 0},
    ])
    (s0, zero), (s1, full), (s2, events), (s3, lm_eval), (s4, refused) = answers
    assert (s0, s1, s2, s3) == (200, 200, 200, 200), answers

    # max_tokens 0: the prompt alone, scored; nothing generated.
    choice = zero["choices"][0]
    lps = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert zero["usage"]["completion_tokens"] == 0 and zero["usage"]["prompt_tokens"] == len(ids)
    assert len(lps["tokens"]) == len(ids) and "".join(lps["tokens"]) == PROMPT
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["text_offset"] == [len("".join(lps["tokens"][:i])) for i in range(len(ids))]
    for position in range(1, len(ids)):
        entry = reference[position]
        assert lps["token_logprobs"][position] == entry[ids[position]].logprob
        top = {lp.decoded_token: lp.logprob for lp in entry.values()}
        assert lps["top_logprobs"][position] == top and 2 <= len(top) <= 3

    # With a completion: the prompt's entries, then the completion's, offsets into the whole text.
    choice = full["choices"][0]
    lps = choice["logprobs"]
    completion = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert choice["text"] == PROMPT + completion.text
    assert len(lps["tokens"]) == len(ids) + 3 and lps["token_logprobs"][:len(ids)] == zero["choices"][0]["logprobs"][
        "token_logprobs"]
    assert lps["text_offset"][len(ids)] == len(PROMPT)
    assert full["usage"]["completion_tokens"] == 3 and full["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # Streamed: each choice's first chunk is its prompt; the chunks add up to the same choice.
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert chunks[0]["text"] == PROMPT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed = {key: [v for c in chunks for v in c["logprobs"][key]] for key in lps}
    assert streamed == lps

    # lm-eval's request: choices per prompt, the continuation's logprobs at [ctxlen:-1].
    for c, prompt in zip(lm_eval["choices"], [ids, ids[:12]]):
        got = c["logprobs"]["token_logprobs"]
        assert len(got) == len(prompt) + 1 and got[0] is None
        # Two prompts batched in one step: a different summation order than alone, hence approx.
        assert got[1:len(prompt)] == pytest.approx([reference[p][ids[p]].logprob for p in range(1, len(prompt))],
                                                   abs=1e-4)
        assert c["text"].startswith(tokenizer.decode(prompt))
    assert (refused["error"]["param"], refused["error"]["code"]) == ("max_tokens", "invalid_value")
    assert "echo" in refused["error"]["message"]  # max_tokens 0 only with echo


def test_echo_without_logprobs_keeps_the_prefix_cache(loaded):
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "temperature": 0}
    (s1, first), (s2, second), (s3, scored) = serve(loaded, [body, body, {**body, "logprobs": 0}])
    assert (s1, s2, s3) == (200, 200, 200)
    assert first["choices"][0]["text"].startswith(PROMPT) and first["choices"][0]["logprobs"] is None
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # no logits needed: the cache serves
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # prompt logprobs: computed afresh
    assert scored["choices"][0]["text"] == second["choices"][0]["text"] == first["choices"][0]["text"]
    assert all(len(top) == 1 for top in scored["choices"][0]["logprobs"]["top_logprobs"][1:])


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(loaded):
    sampled = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    answers = serve(loaded, [
        {**sampled, "n": 4, "logprobs": 0},  # the candidates best_of=4 draws (seeds seed + i)
        {**sampled, "best_of": 4},
        {**sampled, "best_of": 4, "n": 2, "logprobs": 1},
        {**sampled, "best_of": 1, "n": 2},
        {**sampled, "best_of": 3, "stream": True},
    ])
    (_, all4), (s1, best1), (s2, best2), (s3, fewer), (s4, streamed) = answers
    assert (s1, s2) == (200, 200), answers
    ranked = sorted(all4["choices"], key=lambda c: sum(c["logprobs"]["token_logprobs"]), reverse=True)
    assert [c["text"] for c in best1["choices"]] == [ranked[0]["text"]] and best1["choices"][0]["logprobs"] is None
    assert [c["text"] for c in best2["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best2["choices"]] == [0, 1] and best2["choices"][0]["logprobs"]["top_logprobs"]
    assert best1["usage"]["completion_tokens"] == all4["usage"]["completion_tokens"]  # every candidate counts
    assert (s3, fewer["error"]["param"]) == (400, "best_of") and "at least n" in fewer["error"]["message"]
    assert (s4, streamed["error"]["param"]) == (400, "best_of") and "streamed" in streamed["error"]["message"]
