"""The scheduler's copy of a constrained request's grammar: cuts a proposal at the first draft the
grammar refuses, so no slot is spent on a draft that cannot be accepted.

    DraftGrammar(compiled)             compiled: the request's compiled grammar (structured/compiler.py's
                                       CompiledGrammar; only its `start_matcher()` is used, an llguidance matcher)
        .valid_drafts(output, drafts)  advances past the output tokens it has not seen, then counts the
                                       drafts the grammar allows in a row (the matcher does not take them)

This only saves work: what keeps a constrained request's output exact is the worker, whose rows
sample under the grammar's mask after the drafts before them (structured/matcher.py's
`draft_masks`). Torch-free, like the rest of spec_decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class DraftGrammar:
    def __init__(self, compiled: Any):
        self.compiled = compiled
        self._matcher = compiled.start_matcher()
        self.num_consumed = 0  # output tokens the matcher has taken

    def valid_drafts(self, output_token_ids: Sequence[int], drafts: Sequence[int]) -> int:
        """How many of `drafts`, from the first, the grammar allows after `output_token_ids` (the
        request's output so far, which only grows). EOS counts only where the grammar allows it
        before being complete; after a token the grammar refused, no draft is allowed."""
        if len(output_token_ids) < self.num_consumed:
            raise ValueError(f"the output has {len(output_token_ids)} tokens, but the grammar took "
                             f"{self.num_consumed}: an output only grows")
        if len(output_token_ids) > self.num_consumed and not self._matcher.is_error():
            self._matcher.consume_tokens(list(output_token_ids[self.num_consumed:]))
        self.num_consumed = len(output_token_ids)
        if self._matcher.is_error() or not drafts:
            return 0
        return self._matcher.validate_tokens(list(drafts))
