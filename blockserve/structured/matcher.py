"""One request's position in its grammar: fills the step's token bitmask, accepts each token.

A matcher is a copy of the compiled grammar's start state. The worker builds one whenever it
takes a request in (first admission, or re-admission after preemption, replaying the output
tokens so far), so its state always equals the tokens the request holds; it is dropped with the
request (finish, abort, preemption).

Bitmask layout (llguidance's): int32 words, bit j of word w allows token 32 * w + j.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from blockserve.structured.compiler import CompiledGrammar

logger = logging.getLogger("blockserve")


class GrammarMatcher:
    def __init__(self, compiled: CompiledGrammar, output_token_ids: Iterable[int] = ()):
        self.compiled = compiled
        self._matcher = compiled.start_matcher()
        self.num_accepted = 0
        for token in output_token_ids:
            self.accept(token)

    @property
    def num_words(self) -> int:
        """int32 words in one bitmask row: ceil(vocab_size / 32)."""
        return (self.compiled.vocab_size + 31) // 32

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the tokens allowed next into `row` (contiguous int32 [num_words], on the CPU).
        A matcher in error allows only EOS, so the request ends instead of emitting garbage."""
        if row.dtype != torch.int32 or not row.is_contiguous() or row.numel() != self.num_words or row.is_cuda:
            raise ValueError(f"the bitmask row must be a contiguous CPU int32 tensor of {self.num_words} words")
        if not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if self._matcher.is_error():
            row.zero_()
            eos = self.compiled.eos_token_id
            bit = 1 << (eos % 32)
            row[eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # as a signed int32

    def accept(self, token: int) -> None:
        """Advance past `token` (one the bitmask allowed). A token the grammar refuses puts the
        matcher in error (logged once), after which only EOS is allowed."""
        self.num_accepted += 1
        if self._matcher.is_error():
            return
        if not self._matcher.consume_token(token) and token != self.compiled.eos_token_id:
            logger.warning("grammar (%s) refused token %d: %s", self.compiled.kind, token,
                           self._matcher.get_error().splitlines()[0] if self._matcher.get_error() else "")

    @property
    def is_finished(self) -> bool:
        """True once the grammar is complete (only EOS can follow) or stopped."""
        return self._matcher.is_stopped()
