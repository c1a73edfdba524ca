"""GPT-OSS's harmony format (openai_api/harmony.py): channels split into reasoning_content and
content, calls to functions.NAME into tool_calls, whole and streamed however the text is cut;
chat.py's message and deltas from a forced output; the detokenizer keeping the special tokens
the reader needs; and, through the app on a tiny random model, a harmony template detected and
rendering the tools, the text keeping its channels, <|call|> ending the turn, a forced tool
choice answered through the envelope."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from transformers import LlamaConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.detokenizer import IncrementalDetokenizer
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.sampling_params import SamplingParams
from blockserve.server.openai_api.chat import _events, _harmony_message
from blockserve.server.openai_api.harmony import HarmonyStream, parse_harmony, speaks_harmony
from blockserve.server.protocol import ChatCompletionRequest
from blockserve.server.tools.envelope import tool_setup
from tests.server.asgi import asgi_request, serve_app, sse_events
from tests.server.test_async_engine import SIZES
from tests.server.test_reasoning import ForcedStream, output

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
# harmony, cut down: tools listed in a developer message, prior calls and results in their channels
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for t in tools %}type {{ t.function.name }} = (_: any) => any;\n{%- endfor %}}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{%- for c in m.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
OUTPUT = ("<|channel|>analysis<|message|>User asks weather. Call it.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
          '{"city": "Paris"}<|call|>')
ANSWER = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>"


def setup(parallel: bool = True, tools=(WEATHER,)):
    return tool_setup(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=list(tools),
                                            parallel_tool_calls=parallel))


def streamed(text_pieces: list[str], tools=None) -> tuple[str, str, dict]:
    reader = HarmonyStream(tools)
    reasoning, content, calls = "", "", {}
    for piece in text_pieces + [None]:
        r, c, deltas = reader.feed(piece) if piece is not None else reader.finish()
        reasoning, content = reasoning + r, content + c
        for d in deltas:
            if d.id is not None:
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    return reasoning, content, calls


def cuts(text: str) -> list[list[str]]:
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text), 3)]


def test_analysis_is_reasoning_and_final_is_content():
    assert parse_harmony(ANSWER, None) == ("Easy.", "Paris.", None)
    assert parse_harmony("<|channel|>final<|message|>Hi.<|return|>", None) == (None, "Hi.", None)
    # cut off by max_tokens: an open body keeps what it said, an open header says nothing
    assert parse_harmony("<|channel|>analysis<|message|>Thinking", None) == ("Thinking", None, None)
    assert parse_harmony("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|chan", None) == ("A.", None, None)


def test_a_call_to_a_listed_function_is_a_tool_call():
    reasoning, content, calls = parse_harmony(OUTPUT, setup())
    assert (reasoning, content) == ("User asks weather. Call it.", None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    # the recipient before the channel, as gpt-oss also writes it
    other = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    _, _, calls = parse_harmony("<|channel|>final<|message|>Checking.<|end|>" + other, setup())
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    # an unlisted function is no call: its body stays content
    assert parse_harmony(OUTPUT, None) == ("User asks weather. Call it.", '{"city": "Paris"}', None)


def test_calls_after_the_first_are_dropped_without_parallel_calls():
    second = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
              '{"city": "Rome"}<|call|>')
    _, _, calls = parse_harmony(OUTPUT + second, setup(parallel=True))
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    _, _, calls = parse_harmony(OUTPUT + second, setup(parallel=False))
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris"]


@pytest.mark.parametrize("text", [ANSWER, OUTPUT])
def test_streaming_matches_the_whole_however_the_text_is_cut(text):
    tools = setup()
    reasoning, content, calls = parse_harmony(text, tools)
    expected = (reasoning or "", content or "", {i: [c.function.name, c.function.arguments]
                                                   for i, c in enumerate(calls or [])})
    for pieces in cuts(text):
        got = streamed(pieces, tools)
        assert got == expected, pieces
        assert "<|" not in got[0] + got[1]  # no special token leaks out


def test_the_message_and_the_stream_carry_the_channels():
    tools = setup()
    message, finish = _harmony_message(output(OUTPUT), lambda text: parse_harmony(text, tools))
    assert (message.reasoning_content, message.content, finish) == ("User asks weather. Call it.", None, "tool_calls")
    assert message.tool_calls[0].function.name == "get_weather"

    async def run():
        header = dict(id="chatcmpl-x", created=0, model="m")
        pieces = [ANSWER[i:i + 7] for i in range(0, len(ANSWER), 7)]
        return [e async for e in _events(header, ForcedStream(pieces), 1, False, False, 0,
                                         lambda: HarmonyStream(None), None, True)]

    events = [e for e in sse_events("".join(asyncio.run(run())).encode()) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Easy."
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def harmony_tokenizer(smollm2_gguf_tokenizer):
    tokenizer = copy.deepcopy(smollm2_gguf_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_the_detokenizer_keeps_special_tokens_when_asked(harmony_tokenizer):
    ids = harmony_tokenizer.encode(ANSWER, add_special_tokens=False)
    prompt = harmony_tokenizer.encode("<|start|>assistant", add_special_tokens=False)
    for skip, expected in [(True, "analysisEasy.assistantfinalParis."), (False, ANSWER)]:
        detokenizer = IncrementalDetokenizer(harmony_tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
        text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.finish()
        assert text == expected


def test_a_harmony_template_is_detected(harmony_tokenizer, smollm2_gguf_tokenizer):
    assert speaks_harmony(harmony_tokenizer)
    assert not speaks_harmony(smollm2_gguf_tokenizer)
    plain = copy.deepcopy(smollm2_gguf_tokenizer)
    plain.chat_template = TEMPLATE  # the template without the vocabulary's tokens
    assert not speaks_harmony(plain)


def test_through_the_app_the_template_renders_the_tools_and_the_text_keeps_its_channels(
        tmp_path, harmony_tokenizer):
    path = tmp_path / "tiny-harmony"
    save_random_model(LlamaConfig(**{**SIZES, "vocab_size": len(harmony_tokenizer),
                                     "eos_token_id": harmony_tokenizer.convert_tokens_to_ids("<|return|>")}), path)
    harmony_tokenizer.save_pretrained(path)
    model = load_model(str(path), BACKENDS["exact"])
    message_id = harmony_tokenizer.convert_tokens_to_ids("<|message|>")
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "temperature": 0,
            "max_tokens": 4, "ignore_eos": True,
            "logit_bias": {str(message_id): 100}}  # every token opens a body: the first one in the header's channel

    call_id = harmony_tokenizer.convert_tokens_to_ids("<|call|>")
    ends_at_call = {**body, "ignore_eos": False, "logit_bias": {str(call_id): 100}}
    forced = {**body, "tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "now"}},
              "max_tokens": 40, "ignore_eos": False, "logit_bias": {}}

    async def run(app, engine):
        prompt = engine.tokenizer.apply_chat_template(body["messages"], tools=[WEATHER], tokenize=False,
                                                      add_generation_prompt=True)
        answers = []
        for request in (body, ends_at_call, forced):
            status, _, raw = await asgi_request(app, "POST", "/v1/chat/completions", request)
            answers.append((status, json.loads(raw)))
        return prompt, answers

    prompt, [(status, answer), (status_call, at_call), (status_forced, forced_answer)] = serve_app(
        model, dict(max_model_len=256, block_size=16, num_threads=1, kv_cache_memory="16MiB"), run)
    assert "type get_weather" in prompt and prompt.endswith("<|start|>assistant")
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    # four <|message|> tokens: the first ends the (empty) header, the other three are its body's text
    assert message["content"] == "<|message|>" * 3 and message["reasoning_content"] is None
    # <|call|> ends the turn (it is not the tokenizer's end-of-sequence token)
    assert status_call == 200, at_call
    assert (at_call["usage"]["completion_tokens"], at_call["choices"][0]["finish_reason"]) == (1, "stop")
    # a forced choice takes the envelope's grammar: a call, whatever the random model prefers
    assert status_forced == 200, forced_answer
    choice = forced_answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("now", "{}")]
