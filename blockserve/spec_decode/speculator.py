"""The scheduler's side of speculation: a proposer, when to use it, and the acceptance books.

    schedule():  speculator.begin_step()
                 speculator.prepare_step(candidates, batch_size)          (if speculator.batches)
                 drafts = speculator.propose(request, room, batch_size)   (may be none)
    engine:      speculator.observe_step(rows, seconds)                   (decode steps' measured cost)
    update():    speculator.record(request_id, len(drafts), accepted)
    finish:      speculator.forget(request_id)

Drafts are verified only where they are expected to pay (step_costs.py): the measured cost of the
rows they add to the step against the tokens the request's acceptance so far says they will add.
The rule is applied before the proposer is asked, which is then asked for only the drafts that pay,
so a step the rule declines costs no drafting (a cheap proposer is asked for none, so it follows the
request; a draft model is not called). A request's acceptance is a forgetting average
of its verifications that starts at a prior and forgets it too, so drafts that keep missing drive
it towards 0; below MIN_ACCEPTANCE a request does not draft whatever the rows cost. A request the
rule keeps from drafting probes with one draft after a number of its steps that doubles each time
(4 up to 256), so a request whose drafts start to match is noticed: an accepted probe raises its
acceptance and the rule lets it draft again. It does not probe where the measured costs say that
not even drafts sure to be accepted would pay (a draft model about as costly as the target: its
forwards are part of the steps' measured seconds, as `schedule()` runs them); those costs are
measured again once forgotten (step_costs.py's STALE_AFTER). A step whose running batch reaches
`disable_by_batch_size` does not speculate at all.

A request with structured outputs has its drafts cut at the first one its grammar refuses, by a
grammar matcher of its own kept here at the request's output so far (grammar_cut.py), so no slot is spent on a
draft that cannot be accepted. (What keeps its output exact is the worker: each verified position
samples under the grammar's mask after the drafts before it, worker/model_runner.py.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from blockserve.spec_decode.config import SpeculativeConfig
from blockserve.spec_decode.grammar_cut import DraftGrammar
from blockserve.spec_decode.ngram import NgramProposer
from blockserve.spec_decode.proposer import Proposer
from blockserve.spec_decode.stats import SpeculationStats
from blockserve.spec_decode.step_costs import StepCosts
from blockserve.spec_decode.suffix import SuffixProposer

FIRST_BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 256
PRIOR_ACCEPTANCE = 0.5  # a request's acceptance before its own drafts say otherwise...
PRIOR_WEIGHT = 2.0  # ...worth this many tried positions
MIN_ACCEPTANCE = 0.1  # below it a request drafts only to probe: a verification's bookkeeping (slots taken
# and given back, the rejection) costs what the row counts' measured seconds do not resolve
FORGETTING = 0.8  # weight of a request's earlier verifications against its latest


@dataclass
class _RequestBooks:
    # Accepted drafts and positions tried (the accepted ones and the first rejected one), recent
    # verifications weighing most; they start at the prior, which is forgotten like any verification,
    # so a request whose drafts always miss sees its acceptance fall towards 0.
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    tried: float = PRIOR_WEIGHT
    declined: int = 0  # steps in a row the cost rule kept it from drafting
    backoff: int = FIRST_BACKOFF_STEPS

    @property
    def acceptance(self) -> float:
        """The chance that its next draft position is accepted, given the ones before it were."""
        return self.accepted / self.tried


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    raise ValueError(f"no proposer for speculative_config.method {config.method!r}")


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None, costs: StepCosts | None = None):
        self.config = config
        self.proposer = proposer or make_proposer(config)
        # A proposer that drafts for many requests at once (a draft model) is asked once per step (prepare_step).
        self._drafting_costs_work = getattr(self.proposer, "always_proposes", False)
        self.batches = self._drafting_costs_work and hasattr(self.proposer, "propose_batch")
        self._prepared: dict[str, list[int]] | None = None  # this step's batched drafts, handed out by propose
        self.costs = StepCosts() if costs is None else costs
        self._books: dict[str, _RequestBooks] = {}
        self._grammars: dict[str, DraftGrammar] = {}  # constrained requests': at their output so far
        self._step_rows = 0  # drafted rows this step so far
        k = config.num_speculative_tokens
        self._drafted = [0] * k
        self._accepted = [0] * k
        self._verifications = self._skipped = 0
        self._seconds = 0.0

    def begin_step(self) -> None:
        """A step is being scheduled: no drafts in it yet."""
        self._step_rows = 0
        self._prepared = None

    def prepare_step(self, candidates: Sequence[tuple], batch_size: int,
                     reserve: Callable[[str, int], bool] | None = None) -> None:
        """For a proposer that drafts in batches (`batches`): draft at once for every request the step
        may verify, given as (request id, its tokens, the most drafts it has room for[, its
        DraftSampling]), each asked for the drafts that pay; `propose` then hands them out. `reserve`
        (request id, n): whether the proposer's cache could take n drafts' rows (a draft model's cache,
        allocated with the target's); a request it refuses gets none this step."""
        asks = []
        for request_id, token_ids, max_tokens, *sampling in candidates:
            n = self._drafts_paying(request_id, max_tokens, batch_size)
            if n and (reserve is None or reserve(request_id, n)):
                asks.append((request_id, token_ids, n, *sampling))
                self._step_rows += n
        began = time.perf_counter()
        self._prepared = self.proposer.propose_batch(asks) if asks else {}
        self._seconds += time.perf_counter() - began
        drain = getattr(self.proposer, "drain_pending", None)
        if drain is not None:  # its cache's orders since its last forward (blocks freed, allocated)
            drain()

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int, batch_size: int,
                grammar: Any = None, output_token_ids: Sequence[int] = ()) -> list[int]:
        """Drafts for the request's next step: at most min(num_speculative_tokens, max_tokens), and
        only as many as are expected to pay in a step of `batch_size` requests (see the module);
        with a `grammar` (structured outputs: the request's compiled grammar; `output_token_ids`: its
        output so far), none past the first the grammar refuses."""
        if self._prepared is not None:
            drafts = self._prepared.pop(request_id, [])[:max_tokens]
            kept = self._grammar_cut(request_id, drafts, grammar, output_token_ids)
            self._step_rows -= len(drafts) - len(kept)
            return kept
        n = self._drafts_paying(request_id, max_tokens, batch_size)  # before asking: a declined step costs no drafting
        if not n and not self._drafting_costs_work:
            self._timed_propose(request_id, token_ids, 0)  # asked for none, it still follows the request (suffix:
            return []  # where its output starts, which joins the cross-request store whole)
        drafts = self._timed_propose(request_id, token_ids, n) if n else []
        drafts = self._grammar_cut(request_id, drafts, grammar, output_token_ids)
        self._step_rows += len(drafts)
        return drafts

    def _grammar_cut(self, request_id: str, drafts: list[int], grammar: Any,
                     output_token_ids: Sequence[int]) -> list[int]:
        """`drafts` up to the first one `grammar` refuses after the request's output (all without one)."""
        if grammar is None or not drafts:
            return drafts
        cut = self._grammars.get(request_id)
        if cut is None or cut.compiled is not grammar:
            cut = self._grammars[request_id] = DraftGrammar(grammar)
        return drafts[:cut.valid_drafts(output_token_ids, drafts)]

    def _drafts_paying(self, request_id: str, max_tokens: int, batch_size: int) -> int:
        """How many drafts to ask a proposer whose drafts cost work for: those expected to pay."""
        if self._over_batch_limit(batch_size):
            return 0
        n = min(self.config.num_speculative_tokens, max_tokens)
        return self._drafts_to_verify(self._books_of(request_id), n, batch_size) if n > 0 else 0

    def _over_batch_limit(self, batch_size: int) -> bool:
        limit = self.config.disable_by_batch_size
        if limit is not None and batch_size >= limit:
            self._skipped += 1
            return True
        return False

    def _books_of(self, request_id: str) -> _RequestBooks:
        books = self._books.get(request_id)
        if books is None:
            books = self._books[request_id] = _RequestBooks()
        return books

    def _timed_propose(self, request_id: str, token_ids: Sequence[int], n: int) -> list[int]:
        began = time.perf_counter()
        drafts = self.proposer.propose(request_id, token_ids, n)
        self._seconds += time.perf_counter() - began
        return drafts

    def _drafts_to_verify(self, books: _RequestBooks, n: int, batch_size: int) -> int:
        """How many of n drafts to verify: those expected to pay (none below MIN_ACCEPTANCE), or one
        as a probe once the request's back-off has passed (0: none, counted as skipped)."""
        k = 0
        rows = batch_size + self._step_rows
        if books.acceptance >= MIN_ACCEPTANCE:
            k = self.costs.best_drafts(n, books.acceptance, batch_size, rows)
        if k:
            books.declined, books.backoff = 0, FIRST_BACKOFF_STEPS
            return k
        books.declined += 1
        if books.declined < books.backoff or not self.costs.best_drafts(n, 1.0, batch_size, rows):
            # (where not even certain drafts would pay, a probe can show nothing: the costs must change first)
            self._skipped += 1
            return 0
        books.declined, books.backoff = 0, min(2 * books.backoff, MAX_BACKOFF_STEPS)
        return 1  # a probe: one draft, enough to see whether its first position starts to match

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step of decodes (each request's token and its drafts: `rows` in all) took `seconds`."""
        self.costs.observe(rows, seconds)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The target accepted the first `num_accepted` of the request's `num_drafts` drafts."""
        if not 0 <= num_accepted <= num_drafts <= len(self._drafted):
            raise ValueError(f"request {request_id}: {num_accepted} of {num_drafts} drafts accepted")
        self._verifications += 1
        for i in range(num_drafts):
            self._drafted[i] += 1
        for i in range(num_accepted):
            self._accepted[i] += 1
        books = self._books.get(request_id)
        if books is not None:
            tried = num_accepted + (num_accepted < num_drafts)
            books.accepted = FORGETTING * books.accepted + num_accepted
            books.tried = FORGETTING * books.tried + tried

    def preempted(self, request_id: str) -> None:
        """The request was preempted: a proposer with a KV cache of its own (a draft model, an MTP head)
        gives the request's blocks back with the target's (`release`)."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(request_id)

    def forget(self, request_id: str) -> None:
        """The request ended: drop everything held for it."""
        self._books.pop(request_id, None)
        self._grammars.pop(request_id, None)
        self.proposer.forget(request_id)

    def close(self) -> None:
        """The engine is closing: the proposer lets go of what it holds (a draft model)."""
        close = getattr(self.proposer, "close", None)
        if close is not None:
            close()

    @property
    def num_requests(self) -> int:
        """Requests something is held for (0 when idle)."""
        return len(self._books) + len(self._grammars) + self.proposer.num_requests

    def stats(self) -> SpeculationStats:
        return SpeculationStats(self._verifications, sum(self._drafted), sum(self._accepted), tuple(self._drafted),
                                tuple(self._accepted), self._seconds, self._skipped)
