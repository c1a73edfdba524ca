"""Tool calling through a template's own (Hermes-style) tools section, server/tools/hermes.py: which
templates count, the prompt it renders (tools, prior calls, tool results), the grammar of forced
choices, the parse and the streamed deltas of `<tool_call>` blocks, and real generation through
the app on a tiny random Llama carrying SmolLM2's tokenizer with a Hermes tools template (forced
choices parse into schema-valid calls whatever the weights)."""

from __future__ import annotations

import copy
import json
import types

import jsonschema
import llguidance
import llguidance.hf
import pytest
from transformers import LlamaConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.server.http.errors import APIError
from blockserve.server.openai_api.chat import chat_messages
from blockserve.server.protocol import ChatCompletionRequest, ToolCall
from blockserve.server.tools.envelope import tool_setup
from blockserve.server.tools.hermes import (
    HermesStream,
    hermes_grammar,
    hermes_history,
    hermes_prompt,
    parse_hermes,
    renders_hermes_tools,
)
from blockserve.structured.grammar import grammar_text
from tests.server.asgi import post_each
from tests.server.test_async_engine import SIZES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A Hermes-style template (the shape of Qwen2.5's): tools listed in the system turn, calls as
# <tool_call> blocks, tool results as <tool_response> blocks in a user turn.
HERMES_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}"
    "{%- else %}{% set system = 'You are a helpful assistant.' %}{% endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou can call these functions, listed inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{% endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object of its name and arguments inside "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{% endif %}"
    "{%- for call in message.tool_calls %}{% set call = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + call.arguments | tojson"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
)

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
               "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]
ARGS = dict(max_model_len=1024, block_size=16, num_threads=1, kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf_tokenizer):
    return smollm2_gguf_tokenizer


@pytest.fixture(scope="module")
def hermes_tokenizer(smollm2_tokenizer):
    hermes = copy.deepcopy(smollm2_tokenizer)  # a copy, so the plain one keeps its template
    hermes.chat_template = HERMES_TEMPLATE
    return hermes


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory, hermes_tokenizer):
    """A tiny random Llama saved with SmolLM2's tokenizer and the Hermes template."""
    path = tmp_path_factory.mktemp("tiny-llama-hermes")
    save_random_model(LlamaConfig(**{**SIZES, "vocab_size": len(hermes_tokenizer),
                                     "max_position_embeddings": 1024,
                                     "bos_token_id": hermes_tokenizer.bos_token_id,
                                     "eos_token_id": hermes_tokenizer.eos_token_id}), path)
    hermes_tokenizer.save_pretrained(path)
    return load_model(str(path), BACKENDS["exact"])


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": QUESTION, **fields})


def setup_of(choice="auto", parallel=None, tools=(WEATHER, TIME)):
    return tool_setup(request(tools=list(tools), tool_choice=choice, parallel_tool_calls=parallel))


# -- which templates are served natively -------------------------------------------------------------------


def test_only_templates_that_render_hermes_calls_count(smollm2_tokenizer, hermes_tokenizer):
    assert renders_hermes_tools(hermes_tokenizer)
    assert not renders_hermes_tools(smollm2_tokenizer)  # plain ChatML: the envelope
    assert not renders_hermes_tools(None)
    mentions_only = types.SimpleNamespace(chat_template=smollm2_tokenizer.chat_template + "{# <tool_call> #}",
                                          get_chat_template=lambda _, tools: mentions_only.chat_template)
    assert not renders_hermes_tools(mentions_only)  # names the tag, renders no tools
    broken = types.SimpleNamespace(chat_template="<tool_call>{{ messages[0].nope() }}",
                                   get_chat_template=lambda _, tools: broken.chat_template)
    assert not renders_hermes_tools(broken)


# -- the prompt --------------------------------------------------------------------------------------------


def test_the_prompt_renders_tools_calls_and_results_in_the_templates_format(hermes_tokenizer):
    call = ToolCall(id="c1", function={"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'})
    messages = hermes_history([{"role": "user", "content": "Weather?"},
                               {"role": "assistant", "content": "", "tool_calls": [call]},
                               {"role": "tool", "content": "12 C", "tool_call_id": "c1"},
                               {"role": "tool", "content": "windy", "tool_call_id": "c1"}])
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "celsius"}
    assert messages[2]["name"] == "get_weather"
    engine = types.SimpleNamespace(tokenizer=hermes_tokenizer)
    text = hermes_tokenizer.decode(hermes_prompt(engine, messages, setup_of(), True)())
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "celsius"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n12 C\n</tool_response>\n<tool_response>\nwindy\n"
            "</tool_response><|im_end|>") in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = hermes_tokenizer.decode(hermes_prompt(engine, messages, None, True)())  # tool_choice "none"
    assert "<tools>" not in plain and "<tool_response>\n12 C" in plain
    bad = ToolCall(id="c2", function={"name": "get_weather", "arguments": "{not json"})
    with pytest.raises(APIError, match="not JSON"):
        hermes_history([{"role": "assistant", "content": "", "tool_calls": [bad]}])
    with pytest.raises(APIError, match="needs tool_call_id"):
        hermes_history([{"role": "tool", "content": "x"}])


# -- the grammar of forced choices -------------------------------------------------------------------------


def block(name, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


OSLO, CET = block("get_weather", {"city": "Oslo", "unit": "celsius"}), block("get_time", {"zone": "CET"})


@pytest.mark.parametrize("choice, parallel, valid, invalid", [
    ("required", None, [OSLO, OSLO + "\n" + CET], ["Hi", block("get_time", {"zone": "EST"}),
                                                   block("nope", {}), OSLO.replace('": ', '":')]),
    ("required", False, [CET], [OSLO + "\n" + CET]),
    ({"type": "function", "function": {"name": "get_time"}}, None, [CET], [OSLO, CET + "\n" + CET]),
])
def test_forced_choices_grammar(smollm2_tokenizer, choice, parallel, valid, invalid):
    grammar = grammar_text(hermes_grammar(setup_of(choice, parallel)))
    tokenizer = llguidance.hf.from_tokenizer(smollm2_tokenizer)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        ok = matcher.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False))
        return ok and matcher.is_accepting()

    assert all(accepts(t) for t in valid) and not any(accepts(t) for t in invalid)
    assert hermes_grammar(setup_of("auto")) is None  # auto generates freely


# -- reading the output ------------------------------------------------------------------------------------

CANNED = ('Let me check both.\n' + OSLO + '\n' + CET + '\n<tool_call>\n{"name": "nope", "arguments": {}}\n'
          '</tool_call>\nAnd <tool_call>{broken</tool_call> done.')


def test_auto_parses_blocks_and_keeps_the_rest_as_content():
    content, calls = parse_hermes(CANNED, setup_of())
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") for c in calls)
    assert content == ('Let me check both.<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'
                       'And <tool_call>{broken</tool_call> done.')
    assert parse_hermes("Just text.\n", setup_of()) == ("Just text.\n", None)
    content, calls = parse_hermes(OSLO + "\n" + CET + "\n", setup_of(parallel=False))
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    content, calls = parse_hermes('<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}', setup_of())
    assert content is None and json.loads(calls[0].function.arguments) == {"zone": "UTC"}  # unclosed, other order


def replay(text: str, size: int, setup) -> tuple[str, list[tuple[str, dict]]]:
    stream = HermesStream(setup)
    content, calls = "", {}
    pieces = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    for piece, deltas in pieces:
        content += piece
        for d in deltas:
            if d.index not in calls:  # a call's first delta: its id, type and name
                assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert stream.called == bool(calls)
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text, parallel", [
    (CANNED, None), (OSLO + "\n" + CET, False), ("Hello <tool_ and <tool_call >\n", None),
    ('<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>', None),
    (block("get_weather", {"city": 'S\u00e3o "P" </tool_call> {x}', "unit": "celsius"}), None),
    ("Plain, then cut <tool_call>\n{\"name\": \"get_ti", None),
], ids=["canned", "not-parallel", "near-misses", "other-order", "tricky-string", "cut"])
def test_streamed_deltas_match_the_parse(text, parallel, size):
    setup = setup_of(parallel=parallel)
    content, calls = parse_hermes(text, setup)
    streamed_content, streamed_calls = replay(text, size, setup)
    assert streamed_content == (content or "")
    assert streamed_calls == [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


# -- through the app, real generation ----------------------------------------------------------------------


def serve(model, bodies):
    return post_each(model, ARGS, "/v1/chat/completions", bodies)


def chat(**fields):
    return {"messages": QUESTION, "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 60, **fields}


HISTORY = QUESTION + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees and windy"}]


def streamed(events) -> tuple[str, dict]:
    content, calls = "", {}
    for chunk in events:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls") or []:
            calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
            calls[d["index"]]["arguments"] += d["function"].get("arguments") or ""
    return content, calls


def test_forced_calls_generate_parse_and_stream_through_the_app(hermes_model, hermes_tokenizer):
    named = {"type": "function", "function": {"name": "get_time"}}
    answers = serve(hermes_model, [
        chat(tool_choice="required", parallel_tool_calls=False, logprobs=True),
        chat(tool_choice=named),
        chat(tool_choice=named, stream=True),
        chat(tool_choice="none", max_tokens=2),
        chat(tool_choice="auto", max_tokens=12),
        chat(tool_choice="auto", max_tokens=12, stream=True),
        chat(messages=HISTORY, max_tokens=2),
    ])
    for status, answer in answers:
        assert status == 200, answer
    (_, required), (_, by_name), (_, events), (_, none), (_, auto), (_, auto_events), (_, history) = answers
    engine = types.SimpleNamespace(tokenizer=hermes_tokenizer)
    native = hermes_prompt(engine, QUESTION, setup_of(), True)()
    assert required["usage"]["prompt_tokens"] == len(native)  # the template's own tools section
    assert none["usage"]["prompt_tokens"] == len(hermes_prompt(engine, QUESTION, None, True)())
    turns = hermes_history(chat_messages(request(messages=HISTORY).messages))
    assert history["usage"]["prompt_tokens"] == len(hermes_prompt(engine, turns, setup_of(), True)())
    raw = "".join(t["token"] for t in required["choices"][0]["logprobs"]["content"])
    raw = raw.removesuffix(hermes_tokenizer.eos_token)  # the grammar's end forces it
    assert raw.startswith('<tool_call>\n{"name": "') and raw.endswith("}\n</tool_call>")
    for answer, names in ((required, SCHEMAS), (by_name, ["get_time"])):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    content, calls = streamed(events)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls" and content == ""
    (call,) = by_name["choices"][0]["message"]["tool_calls"]
    assert list(calls.values()) == [{"name": "get_time", "arguments": call["function"]["arguments"]}]
    # auto: free text (these random weights write no blocks), streamed as the whole answer's content
    choice = auto["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and choice["message"]["tool_calls"] is None
    assert streamed(auto_events) == (choice["message"]["content"], {})
