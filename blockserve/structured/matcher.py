"""One request's position in its grammar: fills the step's token bitmask, accepts each token.

A matcher is a copy of the compiled grammar's start state. The worker builds one whenever it
takes a request in (first admission, or re-admission after preemption, replaying the output
tokens so far), so its state always equals the tokens the request holds; it is dropped with the
request (finish, abort, preemption).

Speculative decoding: `draft_masks(drafts)` gives the bitmask of each position that verifies a
request's drafts (position i's is the grammar's after drafts[:i]), walking a copy of the matcher,
so the matcher itself never holds a draft: after verification it accepts the emitted tokens only,
and its state is the accepted prefix's whatever was rejected. A draft model drafts under a `fork()`
of a matcher its proposer keeps at the request's output (worker/draft_grammar.py).

Bitmask layout (llguidance's): int32 words, bit j of word w allows token 32 * w + j.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence

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

    def draft_masks(self, drafts: Sequence[int]) -> list[FixedMask]:
        """The k + 1 bitmasks that verify k `drafts` (how many the grammar allows in a row is the
        scheduler's cut, spec_decode/grammar_cut.py's DraftGrammar.valid_drafts). Position i's mask
        is the grammar's after drafts[:i], computed on a copy (this matcher does not move). Positions
        past the first draft the grammar refuses repeat the mask before it: that draft is outside its
        position's mask, so the masked target never samples it, it is never accepted, and nothing
        sampled past it is emitted."""
        probe = self.fork()
        masks = []
        for i in range(len(drafts) + 1):
            row = torch.empty(self.num_words, dtype=torch.int32)
            probe.fill_bitmask(row)
            masks.append(FixedMask(row))
            if i == len(drafts):
                break
            token = drafts[i]
            if not masks[-1].allows(token):
                break
            if not probe._matcher.is_error():
                probe._matcher.consume_token(token)  # refused despite the mask: in error, so EOS only next
        masks.extend(masks[-1:] * (len(drafts) + 1 - len(masks)))
        return masks

    def fork(self) -> GrammarMatcher:
        """A copy at this matcher's state that moves on its own (a draft model drafting under the grammar)."""
        forked = copy.copy(self)
        forked._matcher = self._matcher.deep_copy()
        return forked

    def advance_to(self, output_token_ids: Sequence[int]) -> None:
        """Accept the tokens of `output_token_ids` past the `num_accepted` taken already (an output only grows)."""
        if len(output_token_ids) < self.num_accepted:
            raise ValueError(f"the output has {len(output_token_ids)} tokens, but the grammar took "
                             f"{self.num_accepted}: an output only grows")
        for token in output_token_ids[self.num_accepted:]:
            self.accept(token)

    @property
    def is_finished(self) -> bool:
        """True once the grammar is complete (only EOS can follow) or stopped."""
        return self._matcher.is_stopped()


class FixedMask:
    """A bitmask computed ahead (one verification position's, `GrammarMatcher.draft_masks`), read
    by the sampler like a matcher's."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.num_words = mask.numel()

    def fill_bitmask(self, row: torch.Tensor) -> None:
        if row.dtype != torch.int32 or row.numel() != self.num_words:
            raise ValueError(f"the bitmask row must be int32 of {self.num_words} words")
        row.copy_(self.mask)

    def allows(self, token: int) -> bool:
        """Whether the mask allows `token`."""
        return 0 <= token < 32 * self.num_words and bool((int(self.mask[token // 32]) >> (token % 32)) & 1)
