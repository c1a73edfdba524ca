"""The grammars a draft drafts under: per constrained request, a matcher kept at the request's output
(advanced by the tokens appended since its last proposal), and for each proposal a fork of it, which
the draft's runner takes as the request's grammar and advances over each draft it samples. So a
constrained request's drafts are drawn under the grammar's mask, as the target's tokens are."""

from __future__ import annotations

from collections.abc import Sequence

from blockserve.spec_decode.proposer import DraftSampling
from blockserve.structured.matcher import GrammarMatcher


class OutputGrammars:
    def __init__(self):
        self._matchers: dict[str, GrammarMatcher] = {}

    def fork(self, request_id: str, token_ids: Sequence[int], sampling: DraftSampling | None) -> GrammarMatcher | None:
        """A matcher at the end of the request's output (`token_ids` past its prompt), its own to advance;
        None for a request without a grammar (or without a DraftSampling)."""
        spec = None if sampling is None else sampling.params.structured_outputs
        if spec is None:
            return None
        output = token_ids[sampling.num_prompt_tokens:]
        held = self._matchers.get(request_id)
        if held is None or held.compiled is not spec.compiled or held.num_accepted > len(output):
            held = self._matchers[request_id] = GrammarMatcher(spec.compiled)
        held.advance_to(output)
        return held.fork()

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __iter__(self):
        """The ids of the requests a matcher is held for."""
        return iter(self._matchers)
