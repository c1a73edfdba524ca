"""A reasoning model's output split into its thinking block and its answer (vLLM's
`--reasoning-parser`): `reasoning_content` and `content` of a chat message or delta.

    qwen3        <think>thought</think>answer      the block opens in the output (optional)
    deepseek_r1  thought</think>answer             the block opens in the prompt (a leading
                                                   <think> in the output is dropped too)

One generic reader over a start/end tag pair serves both, streamed or not: text that may be the
beginning of a tag cut between tokens is held back until it is known. A block that never closes
(max_tokens reached) is all reasoning; an output without a block is all content.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's thinking block: its tags, and whether the prompt already opened it."""

    start: str
    end: str
    opens_in_prompt: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part, reasoning None when
        the output has no block."""
        reader = ReasoningStream(self)
        reasoning, content = reader.feed(text)
        more_reasoning, more_content = reader.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        return (reasoning if reader.thought else None), content or None


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("<think>", "</think>", opens_in_prompt=False),
    "deepseek_r1": ReasoningFormat("<think>", "</think>", opens_in_prompt=True),
}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """The growing text of one output, as (reasoning, content) deltas: `feed(new_text)` returns
    what became certain, `finish()` what was held back."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self.state = "open" if fmt.opens_in_prompt else "start"  # start | open | reasoning | content
        self.held = ""
        self.thought = fmt.opens_in_prompt  # whether a thinking block was seen

    def feed(self, new_text: str) -> tuple[str, str]:
        text = self.held + new_text
        self.held = ""
        reasoning = ""
        if self.state in ("start", "open"):
            stripped = text.lstrip()
            if stripped.startswith(self.fmt.start):
                text = stripped[len(self.fmt.start):]
                self.state, self.thought = "reasoning", True
            elif self.fmt.start.startswith(stripped):  # all whitespace, or a cut start tag
                self.held = text
                return "", ""
            else:
                self.state = "reasoning" if self.state == "open" else "content"
        if self.state == "reasoning":
            at = text.find(self.fmt.end)
            if at < 0:
                keep = _partial_suffix(text, self.fmt.end)
                self.held = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            reasoning, text = text[:at], text[at + len(self.fmt.end):]
            self.state = "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning in an unclosed block, else content."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "open" and held):
            return held, ""
        return "", held
