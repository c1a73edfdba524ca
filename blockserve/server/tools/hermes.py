"""Tool calling through a chat template's own tools section, in the Hermes format (Qwen2.5,
Qwen3, Hermes 2/3, ...): the template lists the tools, and a call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template counts as Hermes-style when rendering a probe conversation with a probe tool puts the
tool in the prompt and renders a prior assistant call as a block that reads back as that call;
any other template gets the envelope of tools.py.

    tool_choice "auto"     free generation; blocks become tool_calls, the text around them content
    tool_choice "required" a grammar: one or more blocks (one with parallel_tool_calls false)
    named {"function": f}  a grammar: exactly one block calling f
    tool_choice "none"     the template renders no tools; free text

The grammar fixes each block's JSON layout and checks `arguments` against the tool's schema, so
a forced call always parses. In `auto`, a block that is not a call of a listed tool (bad JSON,
an unknown name) is left in the content as it was written; with parallel_tool_calls false the
calls after the first are dropped. The history keeps OpenAI's shape (assistant `tool_calls`
with their arguments as objects, `tool` turns), which the template renders in its own format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache

from blockserve.engine.llm_engine import LLMEngine
from blockserve.engine.tokenizer import render_chat_template
from blockserve.errors import InvalidRequest
from blockserve.sampling_params import StructuredOutputsParams
from blockserve.server.http.errors import APIError
from blockserve.server.protocol import DeltaFunction, DeltaToolCall, ToolCall, ToolCallFunction
from blockserve.structured.json_bounds import JsonBounds, bounded_schema
from blockserve.server.tools.envelope import JsonValueScanner, ToolSetup, history_call_arguments, merge_deltas, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')

_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_7f3a", "description": "probe", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
_PROBE_ARGUMENTS = {"q": "probe_value_7f3a"}
_PROBE_MESSAGES = [
    {"role": "user", "content": "probe question"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe", "type": "function", "function": {
        "name": "probe_tool_7f3a", "arguments": _PROBE_ARGUMENTS}}]},
    {"role": "tool", "tool_call_id": "call_probe", "name": "probe_tool_7f3a", "content": "probe_result_7f3a"},
]


def renders_hermes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template (its tool-use one, if it has several) renders tools
    and prior calls in the Hermes format; False without a template or when it fails on the probe."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return False
    try:
        template = tokenizer.get_chat_template(None, tools=[_PROBE_TOOL])
    except (ValueError, TypeError):
        return False
    return _renders_hermes(template)


@lru_cache(maxsize=16)
def _renders_hermes(template: str) -> bool:
    """The probe on one template's text (a pure function of it, so remembered)."""
    if OPEN not in template:
        return False
    try:
        with_tools = render_chat_template(template, _PROBE_MESSAGES, tools=[_PROBE_TOOL])
        without = render_chat_template(template, _PROBE_MESSAGES[:1])
    except Exception:  # a template that cannot render the probe cannot be served natively
        return False
    if "probe_tool_7f3a" in without or "probe_result_7f3a" not in with_tools:
        return False
    _, calls = read_blocks(with_tools, {"probe_tool_7f3a"}, parallel=True)
    return any(c.function.name == "probe_tool_7f3a" and json.loads(c.function.arguments) == _PROBE_ARGUMENTS
               for c in calls)


def hermes_history(messages: list[dict]) -> list[dict]:
    """chat.py's messages as a tools-aware template takes them: an assistant turn's calls as
    `{"id", "type", "function": {"name", "arguments": <object>}}`, a tool turn with its call's name."""
    names = {}
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                names[call.id] = call.function.name
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": history_call_arguments(i, call)}})
            m["tool_calls"] = calls
        elif m["role"] == "tool":
            if not m.get("tool_call_id"):
                raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id", param="messages",
                               code="invalid_value")
            if m["tool_call_id"] in names:
                m.setdefault("name", names[m["tool_call_id"]])
        out.append(m)
    return out


def hermes_prompt(engine: LLMEngine, messages: list[dict], setup: ToolSetup | None,
                  add_generation_prompt: bool, variables: dict | None = None) -> Callable[[], list[int]]:
    """The prompt as a callable for the engine thread (the tokenizer is that thread's): the
    messages and, unless `setup` is None, the tools, through the template; `variables` are
    checked chat_template_kwargs (engine/template_kwargs.py)."""
    tools = None if setup is None else [t.model_dump(exclude_none=True) for t in setup.tools]

    def render() -> list[int]:
        try:
            ids = engine.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                       add_generation_prompt=add_generation_prompt,
                                                       **(variables or {}))
        except Exception as e:  # the template's own checks are the caller's to fix
            raise InvalidRequest(f"the chat template rejected the messages: {e}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return render


def hermes_grammar(setup: ToolSetup, bounds: JsonBounds = JsonBounds()) -> StructuredOutputsParams | None:
    """The Lark grammar of a forced choice (`required`, named): blocks whose JSON is a call of a
    listed tool with arguments valid against its schema, numbers within `bounds` (the engine's:
    structured/json_bounds.py); None for `auto` (free generation)."""
    if not (setup.required or setup.named):
        return None
    tools = [t for t in setup.tools if setup.named is None or t.function.name == setup.named]
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": t.function.parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _LAYOUT}
    repeat = ' ("\\n" block)*' if setup.parallel and setup.named is None else ""
    return StructuredOutputsParams(grammar=(
        f"start: block{repeat}\n"
        f"block: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
        f"call: %json {json.dumps(bounded_schema(schema, bounds))}\n"))


def read_blocks(text: str, names: set[str], parallel: bool) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a Hermes-format text: each block that is a call of one of `names`
    becomes a call (after the first, dropped unless `parallel`); the rest, and every other
    block as written, is the content, with the whitespace next to a call's block trimmed."""
    content, calls, pos, trim_left = [], [], 0, False
    start = text.find(OPEN)
    while start >= 0:
        body_start = start + len(OPEN)
        end = _block_end(text[body_start:])
        body = text[body_start:] if end is None else text[body_start:body_start + end]
        block_end = len(text) if end is None else body_start + end + len(CLOSE)
        call = _call(body, names)
        if call is not None:
            before = text[pos:start]
            content.append(before.strip() if trim_left else before.rstrip())
            trim_left, pos = True, block_end
            if parallel or not calls:
                calls.append(call)
        start = text.find(OPEN, block_end)
    tail = text[pos:]
    content.append(tail.lstrip() if trim_left else tail)
    return "".join(content), calls


def parse_hermes(text: str, setup: ToolSetup) -> tuple[str | None, list[ToolCall] | None]:
    """(content, tool calls) of a finished output: content None when empty, calls None when none."""
    content, calls = read_blocks(text, {t.function.name for t in setup.tools}, setup.parallel)
    return (content or None) if calls else content, calls or None


def _block_end(body: str) -> int | None:
    """Where the first `</tool_call>` outside a JSON string is in a block's body, or None."""
    in_string = escaped = False
    for i, ch in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif body.startswith(CLOSE, i):
            return i
    return None


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and value.get("name") in names and isinstance(value.get("arguments"), dict)):
        return None
    return ToolCall(id=new_call_id(), function=ToolCallFunction(
        name=value["name"], arguments=json.dumps(value["arguments"], ensure_ascii=False)))


class HermesStream:
    """The growing text of a Hermes-format output, as OpenAI deltas: `feed(new_text)` returns
    (content text, [DeltaToolCall]) for what became certain, `finish()` what was held back.

    Text that may be the start of `<tool_call>` (and whitespace that may precede one) is held
    back. In a block, a call's id and name go out once `{"name": "f", "arguments": ` is read
    (f a listed tool), then its arguments as they come; a block in another layout goes out whole
    at its end, and one that is not a call as content, as written."""

    def __init__(self, setup: ToolSetup):
        self.names = {t.function.name for t in setup.tools}
        self.parallel = setup.parallel
        self.text = ""
        self.pos = 0  # where unread text starts
        self.state = "text"  # text | block | args | after_args
        self.block_start = 0
        self.trim_left = False  # just after a call's block: drop whitespace
        self.index = -1
        self.drop = False  # this block's call is beyond the first, with parallel_tool_calls false
        self.pending = ""  # the whitespace before the open block: dropped if it is a call's
        self.scanner: JsonValueScanner | None = None

    @property
    def called(self) -> bool:
        return self.index >= 0

    def feed(self, new_text: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += new_text
        content, calls = [], []
        while self._advance(content, calls):
            pass
        return "".join(content), merge_deltas(calls)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """The held-back rest at the end of the output: an unclosed block read as a whole."""
        content, calls = [], []
        rest = self.text[self.pos:]
        if self.state == "text":
            content.append(rest.lstrip() if self.trim_left else rest)
        elif self.state == "block":
            body = self.text[self.block_start:]
            if not self._emit_whole(body, calls):
                content.append(self.pending + OPEN + body)
        elif self.state == "args" and rest and not self.drop:
            calls.append(DeltaToolCall(index=self.index, function=DeltaFunction(arguments=rest)))
        self.pos = len(self.text)
        return "".join(content), merge_deltas(calls)

    def _advance(self, content: list[str], calls: list[DeltaToolCall]) -> bool:
        """Read what can be read in the current state; False when it must wait for more text."""
        rest = self.text[self.pos:]
        if self.state == "text":
            if self.trim_left:
                stripped = rest.lstrip()
                self.pos += len(rest) - len(stripped)
                rest = stripped
                if not rest:
                    return False
                self.trim_left = False
            start = rest.find(OPEN)
            if start >= 0:
                before = rest[:start].rstrip()
                content.append(before)
                self.pending = rest[len(before):start]
                self.pos += start + len(OPEN)
                self.state, self.block_start = "block", self.pos
                return True
            keep = _held_back(rest)
            content.append(rest[:len(rest) - keep])
            self.pos += len(rest) - keep
            return False
        body = self.text[self.block_start:]
        if self.state == "block":
            head = _HEAD.match(body)
            if head and head.group(1) in self.names:
                self._open_call(head.group(1), calls)
                self.state, self.pos = "args", self.block_start + head.end()
                self.scanner = JsonValueScanner()
                return True
            end = _block_end(body)
            if end is None:
                return False
            if not self._emit_whole(body[:end], calls):
                content.append(self.pending + OPEN + body[:end + len(CLOSE)])
            self.pos = self.block_start + end + len(CLOSE)
            self.state = "text"
            return True
        if self.state == "args":
            used, complete = self.scanner.scan(rest)
            if used and not self.drop:
                calls.append(DeltaToolCall(index=self.index, function=DeltaFunction(arguments=rest[:used])))
            self.pos += used
            if complete:
                self.state = "after_args"
            return complete
        end = rest.find(CLOSE)  # after_args: the object's "}" and the closing tag
        if end < 0:
            return False
        self.pos += end + len(CLOSE)
        self.state, self.trim_left = "text", True
        return True

    def _open_call(self, name: str, calls: list[DeltaToolCall]) -> None:
        self.drop = self.called and not self.parallel
        if not self.drop:
            self.index += 1
            calls.append(DeltaToolCall(index=self.index, id=new_call_id(), type="function",
                                       function=DeltaFunction(name=name, arguments="")))

    def _emit_whole(self, body: str, calls: list[DeltaToolCall]) -> bool:
        """A block in a layout the head pattern missed, as one delta; False when it is no call."""
        call = _call(body, self.names)
        if call is None:
            return False
        self._open_call(call.function.name, calls)
        if not self.drop:
            calls.append(DeltaToolCall(index=self.index, function=DeltaFunction(arguments=call.function.arguments)))
        self.trim_left = True
        return True


def _held_back(text: str) -> int:
    """How many trailing characters of `text` to hold: a partial `<tool_call>`, and the
    whitespace before it (which is dropped if a call's block follows)."""
    keep = 0
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            keep = k
            break
    body = text[:len(text) - keep]
    return keep + len(body) - len(body.rstrip())
