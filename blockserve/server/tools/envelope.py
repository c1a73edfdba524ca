"""Tool calling for any chat template (the fallback when it has no Hermes-style tools section,
hermes.py): the tool list in the system message and a JSON envelope, enforced by a
grammar, that is either calls or a plain reply (llama.cpp's "generic" format).

    tool_choice "auto"     {"tool_calls": [{"name": "f", "arguments": {...}}, ...]}  or  {"response": "text"}
    tool_choice "required" {"tool_calls": [...]} (at least one call)
    named {"function": f}  {"tool_calls": [{"name": "f", "arguments": {...}}]} (exactly one call of f)
    tool_choice "none"     no tools in the prompt, no grammar: plain text

Each call's `arguments` follow its tool's `parameters` schema; `parallel_tool_calls: false`
allows one call. The history is rendered the same way: an assistant turn's `tool_calls` become
its envelope, and tool results become user turns `{"tool_result": {"name", "tool_call_id",
"content"}}` (consecutive ones merged), which any template accepts. The grammar's JSON layout is
fixed (one line, `, ` and `: `), so `EnvelopeStream` can turn the growing text into OpenAI's
streaming deltas as it comes: a call's id and name once its name is complete, then its
arguments in fragments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from blockserve.sampling_params import StructuredOutputsParams
from blockserve.server.http.errors import APIError
from blockserve.server.protocol import (
    ChatCompletionRequest, DeltaFunction, DeltaToolCall, NamedToolChoice, Tool, ToolCall, ToolCallFunction,
)

_SEPARATORS = (", ", ": ")  # the grammar's JSON layout (structured/grammar.py)


def _dumps(value) -> str:
    return json.dumps(value, separators=_SEPARATORS, ensure_ascii=False)


@dataclass(frozen=True)
class ToolSetup:
    """A request's tools and how they may be called."""

    tools: tuple[Tool, ...]
    required: bool  # no plain reply
    named: str | None  # the one function to call
    parallel: bool

    def envelope_schema(self) -> dict:
        tools = [t for t in self.tools if self.named is None or t.function.name == self.named]
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": t.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel or self.named is not None:
            array["maxItems"] = 1
        call_branch = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                       "additionalProperties": False}
        if self.required or self.named is not None:
            return call_branch
        reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                 "additionalProperties": False}
        return {"anyOf": [call_branch, reply]}

    def structured_outputs(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.envelope_schema())

    def system_text(self) -> str:
        listing = "\n".join(_dumps({"name": t.function.name, "description": t.function.description or "",
                                    "parameters": t.function.parameters or {"type": "object"}})
                            for t in self.tools)
        call = '{"tool_calls": [{"name": <tool name>, "arguments": <its arguments>}]}'
        if self.named is not None:
            how = f"Call the tool {self.named} by replying with only this JSON: {call}."
        elif self.required:
            how = f"Call one or more tools by replying with only this JSON: {call}."
        else:
            how = (f"To call tools, reply with only this JSON: {call}. Otherwise reply with only this JSON: "
                   '{"response": <your reply>}.')
        return f"You can use these tools:\n{listing}\n{how}"


def tool_setup(body: ChatCompletionRequest) -> ToolSetup | None:
    """The request's tools, or None when the output is not a tool envelope (no tools, or
    tool_choice "none"); 400 for a choice that names no listed tool or tools with another constraint."""
    choice = body.tool_choice
    tools = tuple(body.tools or ())
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tool names must be distinct, got {names}", param="tools", code="invalid_value")
    if choice == "none":
        return None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice names {named!r}, which is not among the tools {names}",
                       param="tool_choice", code="invalid_value")
    constrained = (body.response_format is not None and body.response_format.type != "text") \
        or body.structured_outputs is not None
    if constrained:
        raise APIError(400, "tools cannot be combined with response_format or structured_outputs (the tool "
                            "envelope is the output's grammar); send tool_choice \"none\" or drop one",
                       param="tools", code="invalid_value")
    return ToolSetup(tools, required=choice == "required", named=named, parallel=body.parallel_tool_calls is not False)


def history_call_arguments(index: int, call) -> dict:
    """The arguments of a tool call in message `index` of the history, parsed; a 400 naming the
    message if they are not JSON."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        raise APIError(400, f"messages[{index}]: tool call {call.id!r} has arguments that are not JSON",
                       param="messages", code="invalid_value") from None


def render_history(messages: list[dict], setup: ToolSetup | None) -> list[dict]:
    """The chat template's messages: the tool list in the system message; assistant tool_calls
    as envelopes; tool results as user turns. `messages` are chat.py's dicts, an assistant turn's
    calls under "tool_calls" (ToolCall), a tool turn's id under "tool_call_id"."""
    names = {}  # call id -> function name, from the assistant turns so far
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                names[call.id] = call.function.name
                calls.append({"name": call.function.name, "arguments": history_call_arguments(i, call)})
            out.append({"role": "assistant", "content": _dumps({"tool_calls": calls})})
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not call_id:
                raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id", param="messages",
                               code="invalid_value")
            result = _dumps({"tool_result": {"name": names.get(call_id, ""), "tool_call_id": call_id,
                                             "content": m["content"]}})
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        elif m["role"] == "assistant" and setup is not None:
            out.append({"role": "assistant", "content": _dumps({"response": m["content"]})})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if setup is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{setup.system_text()}"}
        else:
            out.insert(0, {"role": "system", "content": setup.system_text()})
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_envelope(text: str) -> tuple[str | None, list[ToolCall] | None]:
    """(content, tool calls) of a complete envelope; (text, None) when it is not one (the output
    was cut off by max_tokens or a stop string)."""
    try:
        envelope = json.loads(text)
    except ValueError:
        return text, None
    if isinstance(envelope, dict) and isinstance(envelope.get("tool_calls"), list):
        return None, [ToolCall(id=new_call_id(), function=ToolCallFunction(
            name=c["name"], arguments=_dumps(c["arguments"]))) for c in envelope["tool_calls"]]
    if isinstance(envelope, dict) and isinstance(envelope.get("response"), str):
        return envelope["response"], None
    return text, None


class EnvelopeStream:
    """The growing text of an envelope, as OpenAI deltas: `feed(new_text)` returns (content
    text, [DeltaToolCall]) for what became certain. Relies on the grammar's fixed layout."""

    _REPLY, _CALLS = '{"response": "', '{"tool_calls": ['
    _NAME, _ARGS = '{"name": "', '", "arguments": '

    def __init__(self):
        self.text = ""
        self.pos = 0
        self.state = "start"  # start | reply | item | name | args | after_args | done | raw
        self.index = -1
        self.scanner = JsonValueScanner()
        self.called = False

    def feed(self, new_text: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += new_text
        content, calls = [], []
        while True:
            rest = self.text[self.pos:]
            if self.state == "start":
                if rest.startswith(self._REPLY):
                    self.state, self.pos = "reply", self.pos + len(self._REPLY)
                elif rest.startswith(self._CALLS):
                    self.state, self.pos = "item", self.pos + len(self._CALLS)
                elif not (self._REPLY.startswith(rest) or self._CALLS.startswith(rest)):
                    self.state = "raw"
                else:
                    break
            elif self.state == "raw":  # not an envelope (cannot happen under the grammar): pass it on
                content.append(rest)
                self.pos = len(self.text)
                break
            elif self.state == "reply":
                decoded, used, closed = _string_prefix(rest)
                content.append(decoded)
                self.pos += used
                if closed:
                    self.state = "done"
                break
            elif self.state == "item":
                if rest.startswith(self._NAME):
                    self.state, self.pos = "name", self.pos + len(self._NAME)
                else:
                    break
            elif self.state == "name":
                end = rest.find(self._ARGS)
                if end < 0:
                    break
                self.index += 1
                self.called = True
                calls.append(DeltaToolCall(index=self.index, id=new_call_id(), type="function",
                                           function=DeltaFunction(name=rest[:end], arguments="")))
                self.state, self.pos = "args", self.pos + end + len(self._ARGS)
                self.scanner = JsonValueScanner()
            elif self.state == "args":
                used, complete = self.scanner.scan(rest)
                if used:
                    calls.append(DeltaToolCall(index=self.index, function=DeltaFunction(arguments=rest[:used])))
                self.pos += used
                if complete:
                    self.state = "after_args"
                else:
                    break
            elif self.state == "after_args":
                if rest.startswith("}, "):
                    self.state, self.pos = "item", self.pos + 3
                elif rest.startswith("}]}"):
                    self.state, self.pos = "done", self.pos + 3
                else:
                    break
            else:  # done
                break
        return "".join(content), merge_deltas(calls)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """Nothing is held back at the end: the grammar's layout makes every delta certain at once."""
        return "", []


class JsonValueScanner:
    """Finds where a JSON object or array that arrives in pieces ends (strings and escapes aware)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, rest: str) -> tuple[int, bool]:
        """How much of `rest` belongs to the value, and whether the value is complete."""
        for i, ch in enumerate(rest):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(rest), False


def merge_deltas(calls: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """Consecutive argument fragments of one call as one delta."""
    out: list[DeltaToolCall] = []
    for call in calls:
        if out and call.id is None and out[-1].index == call.index:
            out[-1].function.arguments = (out[-1].function.arguments or "") + (call.function.arguments or "")
        else:
            out.append(call)
    return out


def _string_prefix(rest: str) -> tuple[str, int, bool]:
    """The decoded text of the longest complete prefix of a JSON string body, the characters it
    used, and whether the string closed. A partial escape (or a lone high surrogate) waits."""
    i = 0
    while i < len(rest):
        ch = rest[i]
        if ch == '"':
            return json.loads('"' + rest[:i] + '"'), i + 1, True
        if ch == "\\":
            if i + 1 >= len(rest):
                break
            if rest[i + 1] == "u":
                if i + 6 > len(rest):
                    break
                if 0xD800 <= int(rest[i + 2:i + 6], 16) < 0xDC00 and i + 12 > len(rest):
                    break  # a high surrogate: wait for its pair
                i += 12 if 0xD800 <= int(rest[i + 2:i + 6], 16) < 0xDC00 else 6
            else:
                i += 2
        else:
            i += 1
    return json.loads('"' + rest[:i] + '"'), i, False
