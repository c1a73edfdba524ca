"""Reasoning output (openai_api/reasoning.py) and chat_template_kwargs: the thinking block split
off into `reasoning_content`, whole and streamed (tags cut between tokens, a block that never
closes, none at all), through chat.py's message and delta building with a forced output, through
the app on a tiny random Llama (whose output never closes a block), and template variables
reaching a template that renders them."""

from __future__ import annotations

import asyncio
import copy
import types

import pytest
from transformers import LlamaConfig

from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.llm import LLM
from blockserve.engine.outputs import CompletionOutput, RequestOutput
from blockserve.errors import InvalidRequest
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.server.config import ServerConfig
from blockserve.server.openai_api.chat import _assistant_message, _events
from blockserve.server.openai_api.reasoning import REASONING_FORMATS, ReasoningStream
from blockserve.server.tools.envelope import parse_envelope
from tests.server.asgi import asgi_request, serve_app, sse_events
from tests.server.test_async_engine import SIZES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]
ARGS = dict(max_model_len=256, block_size=16, num_threads=1, kv_cache_memory="16MiB")
QUESTION = [{"role": "user", "content": "Hi"}]
# ChatML with Qwen3's switch: thinking turned off renders an empty, closed block in the prompt
THINKING_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{%- endif %}"
)


def streamed(fmt, pieces: list[str]) -> tuple[str, str]:
    reader = ReasoningStream(fmt)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = reader.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = reader.finish()
    return reasoning + r, content + c


def cuts(text: str) -> list[list[str]]:
    """`text` in one piece, a character at a time, and cut in two at every place."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


# -- the parser ---------------------------------------------------------------------------------------


def test_a_closed_block_is_split_from_the_answer():
    assert QWEN3.split("<think>Let me see.</think>\n\nParis.") == ("Let me see.", "\n\nParis.")
    assert QWEN3.split("\n<think>a</think>b") == ("a", "b")
    assert R1.split("Let me see.</think>Paris.") == ("Let me see.", "Paris.")
    assert R1.split("<think>Let me see.</think>Paris.") == ("Let me see.", "Paris.")  # a repeated open tag


def test_no_block_is_all_content():
    assert QWEN3.split("Paris.") == (None, "Paris.")
    assert QWEN3.split("Paris <think> is a tag") == (None, "Paris <think> is a tag")
    assert QWEN3.split("<thin") == (None, "<thin")  # a start tag's beginning that never completes
    assert QWEN3.split("") == (None, None)


def test_an_unclosed_block_is_all_reasoning():
    assert QWEN3.split("<think>Still thinking about it") == ("Still thinking about it", None)
    assert QWEN3.split("<think>Almost done</thi") == ("Almost done</thi", None)
    assert R1.split("Still thinking") == ("Still thinking", None)


@pytest.mark.parametrize("fmt, text, expected", [
    (QWEN3, "<think>Let me see.</think>\n\nParis.", ("Let me see.", "\n\nParis.")),
    (QWEN3, "Paris, not <think>.", ("", "Paris, not <think>.")),
    (QWEN3, "<think>unclosed </thi", ("unclosed </thi", "")),
    (QWEN3, "<thi", ("", "<thi")),
    (R1, "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    (R1, "<think>a</think>b</think>", ("a", "b</think>")),
    (R1, "thinking <", ("thinking <", "")),
])
def test_streaming_matches_the_whole_however_the_text_is_cut(fmt, text, expected):
    for pieces in cuts(text):
        assert streamed(fmt, pieces) == expected, pieces


def test_a_tag_cut_between_tokens_is_held_back_not_sent():
    reader = ReasoningStream(QWEN3)
    assert reader.feed("<th") == ("", "")
    assert reader.feed("ink>Hmm") == ("Hmm", "")
    assert reader.feed(" ok</") == (" ok", "")  # "</" may open the end tag
    assert reader.feed("think>Yes") == ("", "Yes")
    assert reader.feed(" </think>") == ("", " </think>")  # after the block, tags are text
    assert reader.finish() == ("", "")


# -- chat.py's messages and deltas, the output forced ---------------------------------------------------


def output(text: str, finish_reason: str | None = "stop", index: int = 0) -> CompletionOutput:
    return CompletionOutput(index=index, text=text, token_ids=list(range(len(text))), finish_reason=finish_reason)


def test_the_message_carries_reasoning_content():
    message, finish = _assistant_message(output("<think>hmm</think>Paris."), None, QWEN3)
    assert (message.reasoning_content, message.content, finish) == ("hmm", "Paris.", "stop")
    message, finish = _assistant_message(output("<think>cut off by max_tok", "length"), None, QWEN3)
    assert (message.reasoning_content, message.content, finish) == ("cut off by max_tok", None, "length")
    message, _ = _assistant_message(output("<think>hmm</think>Paris."), None, None)  # no parser: the text as is
    assert (message.reasoning_content, message.content) == (None, "<think>hmm</think>Paris.")


def test_the_thinking_block_is_split_off_before_the_tool_calls_are_read():
    text = '<think>call it</think>{"tool_calls": [{"name": "f", "arguments": {"x": 1}}]}'
    message, finish = _assistant_message(output(text), parse_envelope, QWEN3)
    assert message.reasoning_content == "call it" and message.content is None and finish == "tool_calls"
    assert message.tool_calls[0].function.name == "f"


class ForcedStream:
    """A RequestStream whose cumulative outputs grow by the given pieces."""

    request_id = "forced"

    def __init__(self, pieces: list[str], finish_reason: str = "stop"):
        self.pieces, self.finish_reason, self.closed = pieces, finish_reason, False

    async def _outputs(self):
        text = ""
        for i, piece in enumerate(self.pieces):
            text += piece
            last = i == len(self.pieces) - 1
            finish = self.finish_reason if last else None
            yield RequestOutput("forced", None, [1, 2], [output(text, finish)], finished=last)

    def __aiter__(self):
        return self._outputs()

    def close(self, reason: str = "abort") -> None:
        self.closed = True


def stream_deltas(pieces: list[str], fmt, finish_reason: str = "stop") -> list[dict]:
    async def run():
        header = dict(id="chatcmpl-x", created=0, model="m")
        return [e async for e in _events(header, ForcedStream(pieces, finish_reason), 1, False, False, 0,
                                         None, fmt)]

    events = [e for e in sse_events("".join(asyncio.run(run())).encode()) if e != "[DONE]"]
    return [e["choices"][0]["delta"] for e in events]


def test_streamed_reasoning_deltas_come_before_the_content_deltas():
    deltas = stream_deltas(["<thi", "nk>Let me", " see.</th", "ink>\n\nPar", "is."], QWEN3)
    assert deltas[0]["role"] == "assistant"
    kinds = [("reasoning" if d.get("reasoning_content") else "content" if d.get("content") else None)
             for d in deltas[1:]]
    kinds = [k for k in kinds if k]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning") and set(kinds) == {"reasoning", "content"}
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nParis."
    assert not any("<" in (d.get("reasoning_content") or "") for d in deltas)  # no tag leaks out


def test_a_streamed_unclosed_block_is_all_reasoning():
    deltas = stream_deltas(["<think>", "still", " going </thi"], QWEN3, "length")
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "still going </thi"
    assert "".join(d.get("content") or "" for d in deltas) == ""


# -- through the app -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, smollm2_gguf_tokenizer):
    """A tiny random Llama with SmolLM2's tokenizer and a template that renders enable_thinking."""
    tokenizer = copy.deepcopy(smollm2_gguf_tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE
    path = tmp_path_factory.mktemp("tiny-llama-thinking")
    save_random_model(LlamaConfig(**{**SIZES, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                                     "eos_token_id": tokenizer.eos_token_id}), path)
    tokenizer.save_pretrained(path)
    return load_model(str(path), BACKENDS["exact"])


def post_all(model, path: str, bodies: list, parser: str | None = None) -> list[tuple[int, object]]:
    config = ServerConfig(reasoning_parser=parser)

    async def run(app, engine):
        import json

        answers = []
        for body in bodies:
            status, headers, raw = await asgi_request(app, "POST", path, body)
            answers.append((status, sse_events(raw) if headers["content-type"].startswith("text/event-stream")
                            else json.loads(raw)))
        return answers

    return serve_app(model, ARGS, run, config)


CHAT = {"messages": QUESTION, "temperature": 0, "max_tokens": 6, "ignore_eos": True}


def test_the_parser_is_opt_in_and_an_unclosed_block_is_all_reasoning(thinking_model):
    [(status, plain)] = post_all(thinking_model, "/v1/chat/completions", [CHAT])
    assert status == 200
    text = plain["choices"][0]["message"]["content"]
    assert text and plain["choices"][0]["message"]["reasoning_content"] is None
    assert "</think>" not in text  # a random model does not close a block: R1's stays open

    answers = post_all(thinking_model, "/v1/chat/completions",
                       [CHAT, {**CHAT, "stream": True},
                        {**CHAT, "ignore_eos": False, "structured_outputs": {"regex": "[a-z]{3}"}}],
                       parser="deepseek_r1")
    (s1, whole), (s2, events), (s3, constrained) = answers
    assert (s1, s2, s3) == (200, 200, 200)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (text, None)
    deltas = [e["choices"][0]["delta"] for e in events if e != "[DONE]" and e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == text
    assert "".join(d.get("content") or "" for d in deltas) == ""
    # a grammar leaves no room for a block: the output is not parsed
    message = constrained["choices"][0]["message"]
    assert message["reasoning_content"] is None and len(message["content"]) == 3

    [(status, qwen)] = post_all(thinking_model, "/v1/chat/completions", [CHAT], parser="qwen3")
    message = qwen["choices"][0]["message"]
    assert (status, message["reasoning_content"], message["content"]) == (200, None, text)  # no block opened


def test_chat_template_kwargs_reach_the_template(thinking_model):
    off = {"enable_thinking": False}
    answers = post_all(thinking_model, "/tokenize", [
        {"messages": QUESTION}, {"messages": QUESTION, "chat_template_kwargs": off},
        {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": True}}])
    (_, thinking), (_, plain), (_, on) = answers
    assert plain["count"] > thinking["count"] == on["count"]
    [(_, text)] = post_all(thinking_model, "/detokenize", [{"tokens": plain["tokens"]}])
    assert text["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")

    answers = post_all(thinking_model, "/v1/chat/completions", [
        {**CHAT, "max_tokens": 1}, {**CHAT, "max_tokens": 1, "chat_template_kwargs": off}])
    (s1, a), (s2, b) = answers
    assert (s1, s2) == (200, 200)
    assert b["usage"]["prompt_tokens"] - a["usage"]["prompt_tokens"] == plain["count"] - thinking["count"]


def test_reserved_template_kwargs_are_a_400_naming_them(thinking_model):
    bad = {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}
    answers = post_all(thinking_model, "/v1/chat/completions", [
        {**CHAT, "chat_template_kwargs": bad}]) + post_all(thinking_model, "/tokenize", [
            {"messages": QUESTION, "chat_template_kwargs": {"tools": []}}])
    for (status, answer), keys in zip(answers, [("messages", "add_generation_prompt"), ("tools",)]):
        assert status == 400, answer
        assert answer["error"]["param"] == "chat_template_kwargs"
        assert all(key in answer["error"]["message"] for key in keys), answer


def test_offline_chat_passes_template_kwargs(thinking_model):
    llm = LLM.__new__(LLM)  # apply_chat_template reads only the engine's tokenizer
    llm.engine = types.SimpleNamespace(tokenizer=thinking_model.tokenizer)
    thinking = llm.apply_chat_template(QUESTION)
    plain = llm.apply_chat_template(QUESTION, chat_template_kwargs={"enable_thinking": False})
    assert len(plain) > len(thinking) and plain[:len(thinking)] == thinking
    with pytest.raises(InvalidRequest, match="conversation"):
        llm.apply_chat_template(QUESTION, chat_template_kwargs={"conversation": []})
