"""An outside fuzzer: schemathesis reads the server's own /openapi.json and sends what it
generates (bodies valid by the schema, and bodies that break it) to every operation of a real
uvicorn on loopback, in this process (tests/server/asgi.py: LoopbackServer), over a tiny random
Llama carrying SmolLM2's tokenizer and chat template. Every answer must be a status the document
lists, with the body it documents (errors in OpenAI's shape), never a 5xx; a body that breaks the
schema must be refused (4xx), and one the schema allows must be answered (2xx) unless it breaks a
rule JSON Schema cannot state (request_rules.UNSTATED: min_tokens over max_tokens, best_of under n,
...), so that no operation has only refusals (schemathesis' "schema validation mismatch"); and a
correct request succeeds afterwards, with every KV block free.

The number of examples is bounded (FUZZ_EXAMPLES per operation and mode) so the run fits the
default suite; `FUZZ_EXAMPLES=500 pytest tests/server/test_fuzz_openapi.py` explores further."""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request

import pytest
import schemathesis
from fastapi.encoders import jsonable_encoder
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from blockserve.engine.config import EngineConfig
from blockserve.engine.core import EngineCore
from blockserve.engine.llm_engine import LLMEngine
from blockserve.server.app import create_app
from blockserve.server.config import ServerConfig
from blockserve.server.openai_api.request_rules import UNSTATED
from blockserve.server.protocol import CompletionLogprobs, TopLogprob
from tests.server.asgi import LoopbackServer
from tests.server.test_request_fields import ARGS, chat_model  # noqa: F401 (a fixture)

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance, negative_data_rejection]
# Small limits, so what the fuzzer asks for stays cheap on the tiny model (past them: a documented 400);
# the shortest deadline a body may ask for is far above the longest request the fuzzer can make of the
# tiny model (~1 s), so an expired deadline (504) would be a failure too.
CONFIG = ServerConfig(max_n=4, max_prompts=4, max_stop=4, request_timeout=60, min_request_timeout=30)


@pytest.fixture(scope="module")
def fuzz_server(chat_model):  # noqa: F811 (the fixture imported above)
    engine_config = EngineConfig(model=chat_model.source, **ARGS)
    engine = LLMEngine(engine_config, EngineCore(engine_config, chat_model))
    with LoopbackServer(create_app(engine, CONFIG)) as server:
        server.engine = engine
        yield server


MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
OPERATIONS = 8  # /health, /metrics, /v1/models, /reset_prefix_cache, completions, chat, tokenize, detokenize


def unstated(error: dict) -> bool:
    """Whether a 400 is for a rule JSON Schema cannot state (request_rules.UNSTATED)."""
    return any(error["code"] == code and error["param"] == param and words in error["message"]
               for code, param, words in UNSTATED)


def check_answer(case, server: LoopbackServer, counts: dict, positive: dict | None = None) -> None:
    """Check one case's answer, counting it by status (and, for a positive case, in `positive`:
    answered, or refused for an unstated rule)."""
    response = case.call_and_validate(base_url=server.base_url, checks=CHECKS, timeout=60)
    counts[response.status_code] = counts.get(response.status_code, 0) + 1
    assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"], body
    if positive is not None:  # what the schema allows is answered, or refused for what it cannot say
        answered = response.status_code < 300
        assert answered or (response.status_code == 400 and unstated(body["error"])), (body, case.body)
        positive["answered" if answered else "unstated"] += 1


@pytest.mark.slow  # FUZZ_EXAMPLES per operation and mode, ~15 s
def test_every_generated_request_gets_a_documented_answer(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == OPERATIONS, [op.label for op in operations]
    counts: dict[int, int] = {}
    refused_all = []  # operations whose every positive case was refused: schemathesis' validation mismatch
    for operation in operations:
        positive = {"answered": 0, "unstated": 0}
        for mode in MODES if len(operation.body) else MODES[:1]:  # nothing to break without a body
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=True, database=None)
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                check_answer(case, fuzz_server, counts, positive if mode is GenerationMode.POSITIVE else None)

            fuzz()
        if not positive["answered"]:
            refused_all.append(operation.label)
        print(f"{operation.label}: positive cases answered {positive['answered']}, refused for an unstated rule "
              f"{positive['unstated']}")
    print(f"schemathesis: {sum(counts.values())} cases over {len(operations)} operations, by status: "
          f"{dict(sorted(counts.items()))}; 5xx: {sum(n for s, n in counts.items() if s >= 500)}; "
          f"validation mismatches: {len(refused_all)}")
    assert not refused_all, refused_all
    assert sum(counts.values()) >= len(operations) * FUZZ_EXAMPLES // 2 and any(s < 300 for s in counts)


def post(server: LoopbackServer, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.base_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, json.loads(response.read())


def test_the_server_serves_correctly_after_the_fuzzer_and_holds_nothing(fuzz_server):
    status, body = post(fuzz_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                         "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    status, body = post(fuzz_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body
    deadline = time.monotonic() + 30
    while (stats := fuzz_server.engine.stats()).num_running or stats.num_waiting or any(stats.kv_usage):
        assert time.monotonic() < deadline, stats  # read across threads: only a snapshot, so wait for idle
        time.sleep(0.05)
    with urllib.request.urlopen(f"{fuzz_server.base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    assert "blockserve_queue_requests" in text and 'finished_reason="error"' not in text


def post_status(server: LoopbackServer, path: str, body: dict) -> tuple[int, dict]:
    try:
        return post(server, path, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [True, False, True]}, "prompt"),  # booleans are not token ids
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, "stream"),  # nor strings booleans
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "4"}, "max_tokens"),  # nor strings numbers
    ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "0", "logprobs": 0, "repetition_penalty": 5e-324}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "0", "request_timeout": 5e-324}, "request_timeout"),  # was a 504
])
def test_what_the_fuzzer_found_is_a_400(fuzz_server, path, body, param):
    """Booleans and strings are not coerced to numbers; a denormal repetition_penalty (it would
    divide the logits to inf, their logprobs NaN, the JSON answer a 500) is refused; so is a
    deadline no engine step can meet (it was accepted, then answered 504)."""
    status, answer = post_status(fuzz_server, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_the_document_lists_the_real_answers(fuzz_server):
    with urllib.request.urlopen(f"{fuzz_server.base_url}/openapi.json", timeout=30) as response:
        document = json.loads(response.read())
    operations = [op for path in document["paths"].values() for op in path.values()]
    assert len(operations) == OPERATIONS and all("422" not in op["responses"] for op in operations)
    assert not document["paths"]["/health"]["get"]["responses"]["200"].get("content")  # an empty 200
    completions = document["paths"]["/v1/completions"]["post"]
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("CompletionRequest")
    request = document["components"]["schemas"]["CompletionRequest"]
    assert request["additionalProperties"] is False and request["properties"]["n"]["minimum"] == 1
    assert "requestBody" in document["paths"]["/tokenize"]["post"]  # read by the route itself, documented here
    # what this server and its engine take (request_rules.py)
    props = request["properties"]
    assert props["n"]["maximum"] == CONFIG.max_n
    assert props["model"]["anyOf"][0]["const"] == CONFIG.served_model_name
    assert props["request_timeout"]["anyOf"][0] == {"type": "number", "minimum": CONFIG.min_request_timeout,
                                                    "maximum": CONFIG.request_timeout}
    assert props["prompt"]["anyOf"][1]["items"]["maximum"] == fuzz_server.engine.vocab_size - 1
    assert props["suffix"]["enum"] == [None, ""]  # an unsupported field: its neutral values only


def test_a_logprob_of_minus_infinity_is_sent_as_vllm_does():
    """A token a grammar or a penalty rules out has logprob -inf, which JSON cannot carry."""
    logprobs = CompletionLogprobs(tokens=["a"], token_logprobs=[-math.inf], top_logprobs=[{"a": -math.inf}],
                                  text_offset=[0])
    assert json.loads(logprobs.model_dump_json())["token_logprobs"] == [-9999.0]
    assert jsonable_encoder(logprobs)["top_logprobs"] == [{"a": -9999.0}]
    assert TopLogprob(token="a", logprob=-math.inf).model_dump(mode="json")["logprob"] == -9999.0
