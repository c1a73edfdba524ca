"""Every field of OpenAI's published requests is either honoured or refused (C7), never ignored.

The fields are walked from the installed `openai` package (both the streaming and the
non-streaming variants of each endpoint's CompletionCreateParams, and the chat message and
stream-option types). Each is in HONOURED (sent, answered 200) or REFUSED (a value that would
change the answer is a 400 `unsupported_parameter` naming the field; the neutral value, where
there is one, is accepted). A field added to the package that is in neither fails the walk.
In-process (plain ASGI calls) on a tiny random Llama carrying the SmolLM2 tokenizer and chat
template.
"""

from __future__ import annotations

import json
import typing

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import chat_completion_message_param as message_params
from openai.types.chat import completion_create_params as chat_params
from transformers import LlamaConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions
from tests.server.asgi import asgi_request, serve_app
from tests.server.test_async_engine import SIZES

ARGS = dict(max_model_len=128, block_size=4, num_threads=1, kv_cache_memory="8MiB")
NONE = object()  # a refused field without a neutral value (other than null)

COMPLETION = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}

# field -> (what to add to the base body, why it is honoured)
COMPLETION_HONOURED = {
    "model": ({"model": "SmolLM2-135M-Instruct"}, "the served model (any other is a 400 model_not_found)"),
    "prompt": ({"prompt": ["Hello", "Hi"]}, "text, token ids, or lists of either"),
    "max_tokens": ({"max_tokens": 2}, "the scheduler's length limit"),
    "n": ({"n": 2}, "LLMEngine fans out n samples"),
    "temperature": ({"temperature": 0.7}, "the sampler's temperature"),
    "top_p": ({"top_p": 0.9}, "the sampler's nucleus filter"),
    "seed": ({"seed": 7}, "a per-request generator"),
    "stop": ({"stop": ["x", "y"]}, "stop strings, applied by the detokenizer"),
    "presence_penalty": ({"presence_penalty": 0.5}, "the sampler's penalties"),
    "frequency_penalty": ({"frequency_penalty": 0.5}, "the sampler's penalties"),
    "logprobs": ({"logprobs": 2}, "top-n logprobs per token from the sampler"),
    "stream": ({"stream": True}, "SSE chunks"),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, "a final usage chunk"),
    "user": ({"user": "u-1"}, "an end-user id for abuse monitoring; never changes the output"),
    "logit_bias": ({"logit_bias": {"1": 5.0, "2": -100}}, "added to the logits by the sampler"),
    "echo": ({"echo": True, "logprobs": 1}, "the prompt (and its tokens' logprobs) before the completion"),
    "best_of": ({"best_of": 2}, "the best n of best_of candidates by cumulative logprob"),
}
# field -> (a value that would change the answer, the neutral value accepted or NONE, why refused)
COMPLETION_REFUSED = {
    "suffix": ("and then", "", "insertion needs a fill-in-the-middle model and template"),
}

CHAT_HONOURED = {
    "model": ({"model": "SmolLM2-135M-Instruct"}, "the served model (any other is a 400 model_not_found)"),
    "messages": ({"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                               {"role": "user", "content": "Hi", "name": "ann"}]},
                 "through the chat template: text parts, developer read as system"),
    "max_tokens": ({"max_tokens": 2}, "the scheduler's length limit (deprecated by OpenAI)"),
    "max_completion_tokens": ({"max_completion_tokens": 2}, "the length limit; wins over max_tokens"),
    "n": ({"n": 2}, "LLMEngine fans out n samples"),
    "temperature": ({"temperature": 0.7}, "the sampler's temperature"),
    "top_p": ({"top_p": 0.9}, "the sampler's nucleus filter"),
    "seed": ({"seed": 7}, "a per-request generator"),
    "stop": ({"stop": "x"}, "stop strings, applied by the detokenizer"),
    "presence_penalty": ({"presence_penalty": 0.5}, "the sampler's penalties"),
    "frequency_penalty": ({"frequency_penalty": 0.5}, "the sampler's penalties"),
    "logprobs": ({"logprobs": True}, "the sampled token's logprob"),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, "the top-n alternatives by rank"),
    "stream": ({"stream": True}, "SSE chunks"),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, "a final usage chunk"),
    "user": ({"user": "u-1"}, "an end-user id for abuse monitoring; never changes the output"),
    "safety_identifier": ({"safety_identifier": "s-1"}, "an end-user id for abuse monitoring; never changes "
                                                         "the output"),
    "metadata": ({"metadata": {"team": "a"}}, "tags for stored completions; never change the output"),
    "prompt_cache_key": ({"prompt_cache_key": "k"}, "a cache-routing hint; the prefix cache is automatic and "
                                                    "never changes the output (C4)"),
    "logit_bias": ({"logit_bias": {"1": 5.0}}, "added to the logits by the sampler"),
    "response_format": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "a grammar (llguidance) masks the logits"),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "a grammar-enforced JSON envelope "
              "(server/tools.py)"),
    "tool_choice": ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
                    "auto, required, named: the envelope's grammar; none: plain text"),
    "parallel_tool_calls": ({"tools": [{"type": "function", "function": {"name": "f"}}],
                             "parallel_tool_calls": False}, "false: the envelope holds one call"),
}
CHAT_REFUSED = {
    "functions": ([{"name": "f"}], [], "function calling is not implemented"),
    "function_call": ("auto", "none", "function calling is not implemented"),
    "modalities": (["text", "audio"], ["text"], "text output only"),
    "audio": ({"voice": "alloy", "format": "wav"}, NONE, "no audio output"),
    "prediction": ({"type": "content", "content": "x"}, NONE, "no predicted outputs"),
    "reasoning_effort": ("low", NONE, "no reasoning control"),
    "verbosity": ("low", NONE, "no verbosity control"),
    "web_search_options": ({}, NONE, "no web search"),
    "moderation": ({"model": "omni-moderation-latest"}, NONE, "no moderation"),
    "store": (True, False, "completions are not stored"),
    "service_tier": ("flex", "auto", "one service tier"),
    "prompt_cache_retention": ("24h", "in_memory", "no per-request cache policy"),
    "prompt_cache_options": ({"mode": "explicit"}, NONE, "no per-request cache policy"),
}

# vLLM's extensions the engine honours (not in OpenAI's spec, so the walk does not see them)
EXTENSIONS = {
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1, "ignore_eos": True,
    "stop_token_ids": [2], "cache_salt": "tenant-a", "structured_outputs": {"regex": "[a-z]"},
}

# chat message fields (every role's, from the package) and stream options
MESSAGE_HONOURED = {"role": "the chat template's role", "content": "text (or text parts)", "name": "passed to the "
                    "chat template", "tool_calls": "rendered as the assistant's tool envelope (server/tools.py)",
                    "tool_call_id": "a tool result, rendered as a user turn"}
MESSAGE_REFUSED = {
    "function_call": ({"name": "f", "arguments": "{}"}, NONE),
    "audio": ({"id": "a"}, NONE),
    "refusal": ("no", NONE),
}
STREAM_OPTIONS_HONOURED = {"include_usage": "a final usage chunk"}
STREAM_OPTIONS_REFUSED = {"include_obfuscation": (True, False)}


def published(*typed_dicts) -> set[str]:
    return {name for t in typed_dicts for name in t.__annotations__}


def message_types() -> list:
    return list(typing.get_args(message_params.ChatCompletionMessageParam))


@pytest.mark.parametrize("fields, honoured, refused, model", [
    (published(completion_params.CompletionCreateParamsNonStreaming, completion_params.CompletionCreateParamsStreaming),
     COMPLETION_HONOURED, COMPLETION_REFUSED, CompletionRequest),
    (published(chat_params.CompletionCreateParamsNonStreaming, chat_params.CompletionCreateParamsStreaming),
     CHAT_HONOURED, CHAT_REFUSED, ChatCompletionRequest),
    (published(*message_types()), MESSAGE_HONOURED, MESSAGE_REFUSED, ChatMessage),
    (published(ChatCompletionStreamOptionsParam), STREAM_OPTIONS_HONOURED, STREAM_OPTIONS_REFUSED, StreamOptions),
], ids=["completions", "chat", "chat-message", "stream-options"])
def test_every_published_field_is_honoured_or_refused(fields, honoured, refused, model):
    assert not set(honoured) & set(refused)
    unclassified = fields - set(honoured) - set(refused)
    assert not unclassified, (f"OpenAI publishes {sorted(unclassified)}, in neither HONOURED nor REFUSED: "
                              "implement each or refuse it in protocol.py, then classify it here")
    assert not (set(honoured) | set(refused)) - fields, "classified fields OpenAI no longer publishes"
    assert fields <= set(model.model_fields), "every published field is declared (to honour or to refuse it)"


# -- through the app -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, smollm2_gguf_tokenizer):
    """A tiny random Llama with SmolLM2's tokenizer and chat template (skipped without the package)."""
    tokenizer = smollm2_gguf_tokenizer
    path = tmp_path_factory.mktemp("tiny-llama-chat")
    save_random_model(LlamaConfig(**{**SIZES, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                                     "eos_token_id": tokenizer.eos_token_id}), path)
    tokenizer.save_pretrained(path)
    return load_model(str(path), BACKENDS["exact"])


async def post(app, path: str, body) -> tuple[int, dict | str]:
    """One POST of `body` (JSON, or raw bytes): (status, the JSON answer, or the raw text of a stream)."""
    status, headers, raw = await asgi_request(app, "POST", path, body)
    return status, json.loads(raw) if headers.get("content-type", "").startswith("application/json") else raw.decode()


def serve(model, body):
    """Run `body(app)` with the app's lifespan (the engine thread) around it."""
    return serve_app(model, ARGS, lambda app, engine: body(app))


def assert_ok(case: str, status: int, answer) -> None:
    assert status == 200, (case, answer)
    if isinstance(answer, str):  # a stream
        assert answer.rstrip().endswith("data: [DONE]") and '"error"' not in answer, (case, answer)
    else:
        assert answer["choices"], (case, answer)


def assert_refused(case: str, status: int, answer, param: str) -> None:
    assert status == 400, (case, answer)
    error = answer["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", param), (case, error)
    assert param in error["message"] and "remove" in error["message"], (case, error)


ENDPOINTS = [("/v1/completions", COMPLETION, COMPLETION_HONOURED, COMPLETION_REFUSED),
             ("/v1/chat/completions", CHAT, CHAT_HONOURED, CHAT_REFUSED)]


def test_honoured_fields_are_answered(chat_model):
    async def body(app):
        for path, base, honoured, _ in ENDPOINTS:
            for field, (patch, _reason) in honoured.items():
                assert_ok(f"{path} {field}", *await post(app, path, {**base, **patch}))
            for field, value in EXTENSIONS.items():
                assert_ok(f"{path} {field}", *await post(app, path, {**base, field: value}))
        chat = {**CHAT, "add_generation_prompt": False}
        assert_ok("add_generation_prompt", *await post(app, "/v1/chat/completions", chat))
        chat = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
        assert_ok("chat_template_kwargs", *await post(app, "/v1/chat/completions", chat))

    serve(chat_model, body)


def test_refused_fields_are_a_400_naming_them_and_neutral_values_pass(chat_model):
    async def body(app):
        for path, base, _, refused in ENDPOINTS:
            for field, (value, neutral, _reason) in refused.items():
                assert_refused(f"{path} {field}", *await post(app, path, {**base, field: value}), field)
                assert_ok(f"{path} {field}=null", *await post(app, path, {**base, field: None}))
                if neutral is not NONE:
                    assert_ok(f"{path} {field}={neutral!r}", *await post(app, path, {**base, field: neutral}))
            stream = {**base, "stream": True}
            options = {"include_obfuscation": True}
            assert_refused(f"{path} obfuscation", *await post(app, path, {**stream, "stream_options": options}),
                           "stream_options.include_obfuscation")
            options = {"include_obfuscation": False}
            assert_ok(f"{path} no obfuscation", *await post(app, path, {**stream, "stream_options": options}))

    serve(chat_model, body)


def test_refused_message_fields_name_the_message(chat_model):
    async def body(app):
        for field, (value, neutral) in MESSAGE_REFUSED.items():
            turn = {"role": "assistant", "content": "Hello!"}
            messages = [{"role": "user", "content": "Hi"}, {**turn, field: value}, {"role": "user", "content": "Hm"}]
            answer = await post(app, "/v1/chat/completions", {**CHAT, "messages": messages})
            assert_refused(field, *answer, f"messages.1.{field}")
            for accepted in (None,) if neutral is NONE else (None, neutral):
                messages[1] = {**turn, field: accepted}
                assert_ok(f"{field}={accepted!r}", *await post(app, "/v1/chat/completions",
                                                                {**CHAT, "messages": messages}))

    serve(chat_model, body)


def test_unknown_fields_are_refused_by_name(chat_model):
    async def body(app):
        for path, base, _, _ in ENDPOINTS:
            status, answer = await post(app, path, {**base, "guided_json": {"type": "object"}})
            assert_refused(path, status, answer, "guided_json")
            assert "unknown or unsupported field 'guided_json'" in answer["error"]["message"]
            status, answer = await post(app, path, {**base, "stream": True, "stream_options": {"usage": True}})
            assert_refused(path, status, answer, "stream_options.usage")
        message = {"role": "user", "content": [{"type": "text", "text": "Hi", "colour": "red"}]}
        status, answer = await post(app, "/v1/chat/completions", {**CHAT, "messages": [message]})
        assert_refused("content part", status, answer, "messages.0.content.0.colour")
        status, answer = await post(app, "/v1/completions", {**COMPLETION, "add_generation_prompt": False})
        assert_refused("chat-only field", status, answer, "add_generation_prompt")
        status, answer = await post(app, "/v1/completions", {**COMPLETION, "chat_template_kwargs": {}})
        assert_refused("chat-only field", status, answer, "chat_template_kwargs")

    serve(chat_model, body)
