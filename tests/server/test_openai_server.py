"""`blockserve serve` driven with the official openai client (and raw HTTP for malformed input).

One server per module, with two API keys and per-key prefix-cache isolation; greedy results are
compared with the offline LLM's for the same prompts and engine arguments, computed in this
process while the server loads.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
import uuid

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockserve import LLM, SamplingParams
from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow  # a `blockserve serve` process on the real model, ~1 minute

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
# One torch thread each: on a loaded 2-core box, two threads per process can be ten times slower.
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory": "128MiB", "max_num_seqs": 64, "num_threads": 1}
CLI_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "128MiB", "--max-num-seqs", "64", "--num-threads", "1",
            "--api-key", KEY_A, "--api-key", KEY_B, "--prefix-cache-isolation", "per-key"]
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 5

COUNTRIES = ["France", "Spain", "Italy", "Germany", "Japan", "Canada", "Egypt", "Peru",
             "Kenya", "Norway", "Chile", "India", "Greece", "Poland", "Mexico", "Turkey"]
WORDS = ["hot", "up", "light", "fast", "happy", "open", "early", "loud",
         "rich", "strong", "wet", "young", "full", "hard", "near", "big"]
PROMPTS = [f"The capital of {c} is" for c in COUNTRIES] + [f"The opposite of {w} is" for w in WORDS]
STOP_PROMPT, STOP = "1, 2, 3, 4,", [" 7"]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(CLI_ARGS, healthy=False) as proc:
        yield proc  # `offline` computes while the server loads; tests wait for health through `client`
        proc.stop()  # SIGTERM drains and exits 0; the port is free again
        assert proc.process.returncode == 0 and "engine stopped" in proc.log(), proc.log()
        with socket.socket() as s:
            s.bind(("127.0.0.1", proc.port))


@pytest.fixture(scope="module")
def offline(server):
    llm = LLM(**ENGINE_ARGS)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    results = {
        "prompts": [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)],
        "prompt_lens": [len(llm.get_tokenizer().encode(p)) for p in PROMPTS],
        "stop": llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=STOP),
                             use_tqdm=False)[0].outputs[0],
        "chats": [o.outputs[0].text for o in llm.chat(CHATS, greedy, use_tqdm=False)],
    }
    del llm
    server.wait_healthy()
    return results


@pytest.fixture(scope="module")
def client(server, offline):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY_A, max_retries=0, timeout=120) as c:
        yield c


def metrics(server) -> dict[str, float]:
    """Sample name (with labels) -> value, parsed with prometheus_client's own parser."""
    status, text = server.request("GET", "/metrics")
    assert status == 200
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def wait_idle(server, timeout: float = 30) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks (the books are back to empty)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["blockserve_num_requests_running"] == 0 and m["blockserve_num_requests_waiting"] == 0
                and m["blockserve_kv_cache_usage_ratio{group=0}"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# -- results equal the offline LLM's --------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.request("GET", "/health")[0] == 200


def test_completions_non_streaming_matches_offline(client, offline):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == offline["prompts"][:2]
    assert response.usage.prompt_tokens == sum(offline["prompt_lens"][:2])
    assert response.usage.completion_tokens == 2 * MAX_TOKENS
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_streaming_matches_offline(client, offline):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline["prompts"][2]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == offline["prompt_lens"][2]


def test_stop_string_matches_offline(client, offline):
    response = client.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=12, temperature=0, stop=STOP)
    expected = offline["stop"]
    assert expected.finish_reason == "stop"
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected.text, "stop")


def test_chat_non_streaming_matches_offline(client, offline):
    response = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == offline["chats"][0]
    assert response.usage.completion_tokens == MAX_TOKENS


def test_chat_streaming_matches_offline(client, offline):
    stream = client.chat.completions.create(model=MODEL, messages=CHATS[1], max_completion_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline["chats"][1]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_concurrent_streaming_clients(server, offline):
    """32 clients stream at once; each gets exactly its own prompt's offline greedy text."""

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            assert chunk.choices[0].index == 0
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY_B, max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))

    results = asyncio.run(main())
    assert len(results) == 32
    assert [text for text, _ in results] == offline["prompts"]
    assert all(finish == "length" for _, finish in results)
    assert wait_idle(server)["blockserve_kv_cache_usage_ratio{group=0}"] == 0


def test_sampling_n_seed_and_logprobs(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=1.0, top_p=0.9, n=2, seed=1234,
                  logprobs=2, extra_body={"top_k": 50, "min_p": 0.01})
    first, again = (client.completions.create(**kwargs) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert [c.index for c in first.choices] == [0, 1]
    for choice in first.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
        assert "".join(lp.tokens) == choice.text
        assert all(2 <= len(top) <= 3 and v <= 0 for top in lp.top_logprobs for v in top.values())
    chat = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=2, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy: the sampled token is the top one


# -- cancellation, the prefix cache and isolation -------------------------------------------------


def test_disconnect_frees_blocks_and_reset_prefix_cache(server, client):
    prompt = f"Request {uuid.uuid4().hex}: please count from one to a thousand, slowly and carefully:"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    wait_idle(server)
    assert server.request("POST", "/reset_prefix_cache", key=KEY_A) == (200, {"success": True})
    after = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert after.usage.prompt_tokens_details.cached_tokens == 0  # the reset forgot it

    # A long request holds blocks: the reset refuses and says why. Then its client goes away.
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    status, body = server.request("POST", "/reset_prefix_cache", key=KEY_A)
    assert status == 409
    assert body["error"]["code"] == "blocks_in_use" and "in use" in body["error"]["message"]
    m = metrics(server)
    assert m["blockserve_num_requests_running"] == 1 and m["blockserve_kv_cache_usage_ratio{group=0}"] > 0
    stream.close()  # disconnect mid-stream
    m = wait_idle(server)
    assert m["blockserve_num_requests_running"] == 0
    assert m["blockserve_kv_cache_usage_ratio{group=0}"] == 0
    assert m["blockserve_request_finished_total{finished_reason=abort}"] >= 1
    assert server.request("POST", "/reset_prefix_cache", key=KEY_A) == (200, {"success": True})


def test_disconnect_during_non_streaming_request_aborts_it(server):
    aborted = metrics(server).get("blockserve_request_finished_total{finished_reason=abort}", 0)
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"})
        deadline = time.monotonic() + 30
        while metrics(server)["blockserve_num_requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics(server)["blockserve_kv_cache_usage_ratio{group=0}"] > 0
    finally:
        conn.close()  # the client goes away without reading the answer
    m = wait_idle(server)
    assert m["blockserve_kv_cache_usage_ratio{group=0}"] == 0 and m["blockserve_num_requests_running"] == 0
    assert m["blockserve_request_finished_total{finished_reason=abort}"] == aborted + 1


def test_tenants_never_share_cached_blocks(server, offline):
    prompt = f"Tenant test {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 4
    clients = {key: openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)
               for key in (KEY_A, KEY_B)}

    def cached(key: str, **extra) -> int:
        response = clients[key].completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        return response.usage.prompt_tokens_details.cached_tokens

    try:
        assert cached(KEY_A) == 0
        assert cached(KEY_B) == 0  # A's blocks are cached, but not for B
        assert cached(KEY_A) > 0  # the same tenant hits its own
        assert cached(KEY_B) > 0
        assert cached(KEY_A, cache_salt="another-salt") == 0  # a body salt scopes further
    finally:
        for c in clients.values():
            c.close()


# -- bad input: the right status and error body, and nothing disturbed -----------------------------


GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
BAD_INPUTS = [
    # (path, body, key, status, error param, error code)
    ("/v1/completions", {**GOOD, "temperature": -1}, KEY_A, 400, "temperature", "invalid_value"),
    ("/v1/completions", {**GOOD, "n": 0}, KEY_A, 400, "n", "invalid_value"),
    ("/v1/completions", {**GOOD, "top_p": 0}, KEY_A, 400, "top_p", "invalid_value"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, KEY_A, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, KEY_A, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, KEY_A, 400, "model", "model_not_found"),
    ("/v1/completions", {**GOOD, "prompt": "word " * 600}, KEY_A, 400, None, "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "prompt": "Hello", "max_tokens": 600}, KEY_A, 400, None, "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "prompt": [1, 2, 10**9]}, KEY_A, 400, None, "invalid_value"),
    ("/v1/completions", {**GOOD, "prompt": []}, KEY_A, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, KEY_A, 400, "stream_options",
     "invalid_value"),
    ("/v1/completions", {k: v for k, v in GOOD.items() if k != "prompt"}, KEY_A, 400, "prompt", "invalid_value"),
    ("/v1/completions", '{"prompt": "Hello", ', KEY_A, 400, None, "invalid_json"),
    ("/v1/completions", "[1, 2]", KEY_A, 400, None, "invalid_value"),
    ("/v1/completions", GOOD, None, 401, None, "missing_api_key"),
    ("/v1/completions", GOOD, "wrong-key", 401, None, "invalid_api_key"),
    ("/v1/chat/completions", GOOD_CHAT, None, 401, None, "missing_api_key"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": []}, KEY_A, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "robot", "content": "x"}]}, KEY_A, 400,
     "messages", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     KEY_A, 400, "messages", "unsupported_content"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_logprobs": 2}, KEY_A, 400, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "presence_penalty": 3}, KEY_A, 400, "presence_penalty", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "model": "nope"}, KEY_A, 400, "model", "model_not_found"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": "word " * 600}]}, KEY_A, 400,
     None, "context_length_exceeded"),
    ("/v1/nothing", GOOD, KEY_A, 404, None, "not_found"),
    ("/reset_prefix_cache", None, None, 401, None, "missing_api_key"),
]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, client, offline):
    for path, body, key, status, param, code in BAD_INPUTS:
        got_status, got = server.request("POST", path, body, key=key)
        case = f"POST {path} {str(body)[:80]!r} key={key}"
        assert got_status == status, (case, got)
        assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, (case, got)
        assert got["error"]["message"] and got["error"]["type"] == "invalid_request_error", (case, got)
        assert (got["error"]["param"], got["error"]["code"]) == (param, code), (case, got)
        assert "Traceback" not in got["error"]["message"]
    assert server.request("GET", "/nowhere", key=KEY_A)[0] == 404
    # The openai client sees them as its own error types.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").models.list()
    # Nothing leaked, and everyone else is still served correctly.
    assert wait_idle(server)["blockserve_kv_cache_usage_ratio{group=0}"] == 0
    response = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == offline["prompts"][3]
    assert server.request("GET", "/health")[0] == 200


def test_metrics_parse_with_prometheus_parser(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=2, temperature=0)
    m = wait_idle(server)
    for name in ("blockserve_num_requests_running", "blockserve_num_requests_waiting",
                 "blockserve_kv_cache_usage_ratio{group=0}", "blockserve_prefix_cache_queries_total",
                 "blockserve_prefix_cache_hits_total", "blockserve_num_preemptions_total",
                 "blockserve_prefix_cache_state_lost_tokens_total"):
        assert name in m, name
    assert m["blockserve_prefix_cache_queries_total"] >= m["blockserve_prefix_cache_hits_total"] >= 0
    assert m["blockserve_prefix_cache_state_lost_tokens_total"] == 0  # SmolLM2: no recurrent state
    assert m["blockserve_prefix_cache_queries_total"] > 0
    assert m["blockserve_prompt_tokens_total"] > 0 and m["blockserve_generation_tokens_total"] > 0
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert m[f"blockserve_{histogram}_count"] > 0
        assert m[f"blockserve_{histogram}_bucket{{le=+Inf}}"] == m[f"blockserve_{histogram}_count"]
