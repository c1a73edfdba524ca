"""Incremental detokenization of one request's output, with stop strings.

    push(ids) ─► DecodeStream ─► held text ─► stop-string check ─► delta (all but the last
                 (whole characters only)                           longest-stop - 1 characters)

Contract: the deltas returned by `push` and `finish` add up to the output text, which is
`tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)` cut before the first stop string to
complete (ties: the longest), decoded in the context of the prompt's last few tokens. For
byte-level BPE (SmolLM2, GPT-2, Llama 3) the context changes nothing unless the prompt ends
inside a character; for SentencePiece-style decoders it keeps the leading space of the first
output word, as vLLM does. Special tokens are skipped, as vLLM's default does, unless
`params.skip_special_tokens` is False (then the contract's decode keeps them).

Why `tokenizers.decoders.DecodeStream`: it decodes a short window of ids in Rust and gives text
only once it forms whole characters, so a character split over several tokens (emoji, CJK) is
never emitted as U+FFFD halves; it costs about a microsecond per token, some six times less
than doing the same windowed decode from Python. It refuses ("Invalid prefix") when a
decoder's output for the window stops extending what it gave before, which byte-fallback
decoders do on invalid UTF-8; we then restart it from the tokens not yet turned into text
(vLLM restarts from the current token alone, which can drop the text of those before it).

Stop strings: a stop string may complete only in text of the `params.min_tokens`-th output token
or later (the scheduler's rule for stop tokens). While streaming, the last (longest stop string
- 1) characters are held back, so a partly matched stop string is never emitted; `finish()`
releases them, and the text of trailing tokens that never formed a whole character.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from blockserve.sampling_params import SamplingParams

_INVALID_PREFIX = "Invalid prefix encountered"
_CONTEXT_TOKENS = range(4, 25)  # prompt suffix lengths tried as decoding context (vLLM's choice)


class IncrementalDetokenizer:
    """One request's text. `stop_string` is the stop string that ended it, if any; once it is
    set, or `finish()` was called, `finished` is True and `push` may not be called again."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise TypeError(
                f"IncrementalDetokenizer needs a fast (Rust-backed) Hugging Face tokenizer, "
                f"got {type(tokenizer).__name__}"
            )
        self._backend = backend
        context = _context(backend, list(prompt_token_ids[-_CONTEXT_TOKENS[-1] :]))
        self._skip_special = params.skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip_special)
        self._ids = list(context)  # context, then output ids
        self._piece = (0, len(context))  # the ids that produced the last piece of text
        self._stops = params.stop
        self._hold = max(map(len, self._stops), default=1) - 1
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self._held = ""  # decoded, not yet returned
        self._checked = 0  # no stop string may end within _held[:_checked] (seen, or protected)
        self.stop_string: str | None = None
        self.finished = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text they finalised (possibly empty)."""
        if self.finished:
            raise RuntimeError("push() after the request's text finished (a stop string matched, or finish() was called)")
        for token_id in token_ids:
            self._ids.append(token_id)
            self._num_tokens += 1
            piece = self._step(token_id)
            if piece:
                self._held += piece
                self._piece = (self._piece[1], len(self._ids))
            if self._num_tokens < self._min_tokens:
                self._checked = len(self._held)
        return self._release(final=False)

    def finish(self) -> str:
        """End the text (the request finished without a stop string): return everything still
        held back. Returns "" when a stop string already ended it."""
        if self.finished:
            return ""
        start, end = self._piece
        if end < len(self._ids):  # tokens that never completed a character, or only special tokens
            before = self._decode(self._ids[start:end])
            self._held += self._decode(self._ids[start:])[len(before) :]
            if self._num_tokens < self._min_tokens:
                self._checked = len(self._held)
        return self._release(final=True)

    def _step(self, token_id: int) -> str | None:
        """The text `token_id` (already appended to _ids) completes, if any."""
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as error:  # tokenizers raises a bare Exception
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)  # restart from the ids not yet decoded
            return self._stream.step(self._backend, self._ids[self._piece[1] :])

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def _release(self, final: bool) -> str:
        """Check for a stop string, then return what may be emitted and keep the rest."""
        cut = self._find_stop()
        if cut is not None:
            delta, self._held, self.finished = self._held[:cut], "", True
        elif final:
            delta, self._held, self.finished = self._held, "", True
        else:
            n = max(0, len(self._held) - self._hold)
            delta, self._held = self._held[:n], self._held[n:]
        self._checked = len(self._held)
        return delta

    def _find_stop(self) -> int | None:
        """Where the first stop string to complete in the unchecked text starts (on a tie, the
        longest); sets `stop_string`. None if none completes."""
        matches = [
            (start + len(stop), -len(stop), start, stop)
            for stop in self._stops
            if (start := self._held.find(stop, max(0, self._checked - len(stop) + 1))) >= 0
        ]
        if not matches:
            return None
        _, _, start, self.stop_string = min(matches)
        return start


def _context(backend: Tokenizer, prompt: list[int]) -> list[int]:
    """The shortest suffix of the prompt (4 to 24 tokens, or the whole of a shorter prompt) that
    decodes without U+FFFD, i.e. starts and ends on character boundaries; [] if none does."""
    for n in _CONTEXT_TOKENS:
        suffix = prompt[-n:]
        if "\ufffd" not in backend.decode(suffix, skip_special_tokens=True):
            return suffix
        if n >= len(prompt):
            break
    return []
