"""GPT-OSS's harmony chat format read back: the model's messages split by channel into
`reasoning_content`, `content` and `tool_calls`, whole or streamed.

The prompt ends with `<|start|>assistant`, so the output opens inside a message's header:

    <|channel|>analysis<|message|>thought<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>answer<|return|>

    analysis channel                  reasoning_content
    a recipient functions.NAME        a tool call of NAME (a listed tool), its body the arguments; the
    (before or after the channel)     calls after the first are dropped with parallel_tool_calls false
    any other message                 content (final, a commentary preamble, a call of an unlisted tool)

A message cut off (max_tokens) keeps what it said; a header cut off says nothing. The text must
keep the special tokens (SamplingParams.skip_special_tokens False), and `<|return|>` and
`<|call|>` must end the output (`turn_end_ids`), which is what chat.py asks for when the chat
template speaks harmony.

Why not the `openai-harmony` package: its parser reads o200k_harmony token ids, an encoding it
downloads at first use; this reader works on the text of any tokenizer, offline.
"""

from __future__ import annotations

import re

from blockserve.server.protocol import DeltaFunction, DeltaToolCall, ToolCall, ToolCallFunction
from blockserve.server.tools.envelope import ToolSetup, merge_deltas, new_call_id

START, MESSAGE, CONSTRAIN = "<|start|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_SPECIAL = ("<|channel|>", MESSAGE, START, "<|end|>")


def speaks_harmony(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders harmony: it writes `<|channel|>` and the
    vocabulary has harmony's special tokens."""
    template = getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not isinstance(template, str) or "<|channel|>" not in template:
        return False
    vocab = tokenizer.get_vocab()
    return all(token in vocab for token in _SPECIAL)


def turn_end_ids(tokenizer) -> tuple[int, ...]:
    """The ids of `<|return|>` and `<|call|>`, the tokens that end an assistant turn (gpt-oss's
    generation_config lists them beside the tokenizer's one end-of-sequence token)."""
    vocab = tokenizer.get_vocab()
    return tuple(vocab[token] for token in ("<|return|>", "<|call|>") if token in vocab)


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) and len(m) > n for m in markers):
            return n
    return 0


class HarmonyStream:
    """The growing text of one harmony output: `feed(new_text)` returns (reasoning, content,
    [DeltaToolCall]) for what became certain, `finish()` what was held back. A call's id and
    name go out when its header is read, its arguments as they come."""

    def __init__(self, setup: ToolSetup | None):
        self.names = set() if setup is None else {t.function.name for t in setup.tools}
        self.parallel = True if setup is None else setup.parallel
        self.text, self.pos = "", 0
        self.state = "header"  # header | body | between
        self.route = "content"  # the open body's: reasoning | content | call | drop
        self.index = -1

    @property
    def called(self) -> bool:
        return self.index >= 0

    def feed(self, new_text: str) -> tuple[str, str, list[DeltaToolCall]]:
        self.text += new_text
        out = {"reasoning": [], "content": [], "calls": []}
        while self._advance(out):
            pass
        return "".join(out["reasoning"]), "".join(out["content"]), merge_deltas(out["calls"])

    def finish(self) -> tuple[str, str, list[DeltaToolCall]]:
        out = {"reasoning": [], "content": [], "calls": []}
        rest = self.text[self.pos:]
        if self.state == "body":
            self._emit(rest, out)
        elif self.state == "between":
            out["content"].append(rest)
        self.pos = len(self.text)
        return "".join(out["reasoning"]), "".join(out["content"]), merge_deltas(out["calls"])

    def _advance(self, out: dict) -> bool:
        """Read what the current state can; False when it must wait for more text."""
        rest = self.text[self.pos:]
        if self.state == "header":
            at = rest.find(MESSAGE)
            if at < 0:
                return False
            self._open(rest[:at], out)
            self.pos += at + len(MESSAGE)
            self.state = "body"
            return True
        markers = ENDS if self.state == "body" else (START,)
        found = [(at, m) for m in markers if (at := rest.find(m)) >= 0]
        if not found:
            keep = _partial(rest, markers)
            self._emit(rest[:len(rest) - keep], out) if self.state == "body" else \
                out["content"].append(rest[:len(rest) - keep])
            self.pos += len(rest) - keep
            return False
        at, marker = min(found)
        if self.state == "body":
            self._emit(rest[:at], out)
            self.state = "between"
        else:  # text outside any message is content, as written
            out["content"].append(rest[:at])
            self.state = "header"
        self.pos += at + len(marker)
        return True

    def _open(self, header: str, out: dict) -> None:
        """Route the body that follows `header` (its role, channel, recipient, content type)."""
        header = header.split(CONSTRAIN, 1)[0]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        name = recipient.group(1).removeprefix("functions.") if recipient else None
        if recipient and recipient.group(1).startswith("functions.") and name in self.names:
            if self.called and not self.parallel:
                self.route = "drop"
                return
            self.route, self.index = "call", self.index + 1
            out["calls"].append(DeltaToolCall(index=self.index, id=new_call_id(), type="function",
                                              function=DeltaFunction(name=name, arguments="")))
        elif channel and channel.group(1) == "analysis":
            self.route = "reasoning"
        else:
            self.route = "content"

    def _emit(self, text: str, out: dict) -> None:
        if not text or self.route == "drop":
            return
        if self.route == "call":
            out["calls"].append(DeltaToolCall(index=self.index, function=DeltaFunction(arguments=text)))
        else:
            out[self.route].append(text)


def parse_harmony(text: str, setup: ToolSetup | None) -> tuple[str | None, str | None, list[ToolCall] | None]:
    """(reasoning, content, calls) of a whole output; None for each part it lacks."""
    reader = HarmonyStream(setup)
    reasoning, content, calls = reader.feed(text)
    more_reasoning, more_content, more_calls = reader.finish()
    merged = merge_deltas(calls + more_calls)
    tool_calls = [ToolCall(id=c.id, function=ToolCallFunction(name=c.function.name, arguments=c.function.arguments))
                  for c in merged]
    return reasoning + more_reasoning or None, content + more_content or None, tool_calls or None
