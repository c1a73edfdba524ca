"""What passes between the scheduler and the worker each step.

    scheduler ──SchedulerOutput──► worker ──ModelRunnerOutput──► scheduler.update_from_output
                                                                      │
                                          RequestOutput per request ◄─┘ + SchedulerStats
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from blockserve.kv.tiers.store import OffloadStats
from blockserve.sampling_params import SamplingParams
from blockserve.spec_decode.stats import SpeculationStats


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker has not seen (first admission, or re-admission after preemption).

    `block_ids[group]` is its whole block table; `num_computed_tokens` tokens of it are a
    prefix-cache hit whose KV is already in place.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int
    eos_token_id: int | None = None
    # A grammar matcher already at the output's end, which the worker takes as the request's (a draft's runner:
    # a fork of its proposer's); None: built from sampling_params.structured_outputs where it has one
    grammar: Any = None


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker already holds: only the block ids appended this step, per group."""

    request_id: str
    new_block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """One step of work. Token ids to compute for request r are
    `token_ids[r][num_computed_tokens : num_computed_tokens + num_scheduled_tokens[r]]`,
    given here as `scheduled_token_ids[r]` so the worker re-derives nothing."""

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    scheduled_token_ids: dict[str, list[int]]
    total_num_scheduled_tokens: int
    blocks_to_zero: dict[int, list[int]]  # C1 zero orders, per group, to apply before the forward pass
    blocks_to_poison: dict[int, list[int]]  # poison mode only: fill with NaN, before the zero orders
    finished_request_ids: set[str]  # finished or aborted since the last step: drop their state
    preempted_request_ids: set[str]  # preempted this step: drop their state
    # State groups (kv/pending.py): restores after the poison orders, before the zero orders;
    # captures during the forward.
    state_copies: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # (checkpoint, running slot)
    state_captures: dict[int, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)  # (position, slot)
    # The second tier (kv/pending.py): saves first (copy the block out), loads after the copies, before zeros.
    blocks_to_save: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)  # (block, tier key)
    blocks_to_load: dict[int, list[tuple[int, bytearray]]] = field(default_factory=dict)  # (block, payload)
    # Speculative decoding: a request's draft tokens, the last len(drafts) of its scheduled token ids. The
    # worker scores every one and returns the accepted drafts plus the target's next token.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per scheduled request, the tokens sampled this step (empty while its prompt is unfinished; with
    drafts, the accepted ones and then the target's own token)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list] = field(default_factory=dict)  # per request, one entry per sampled token
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # requests whose prompt completed (prompt_logprobs.py)
    # A runner that keeps them (a sampling draft's, ModelRunner.keep_distributions): per request sampling one
    # token, the distribution [V] it was drawn from
    distributions: dict = field(default_factory=dict)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "rejected" once finished
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    num_cached_tokens: int = 0
    new_logprobs: list | None = None
    error: str | None = None
    prompt_logprobs: list | None = None  # with the first token only: one entry per prompt token after the first

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: list[float]  # per group
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    prefix_cache_state_lost_tokens: int  # cumulative: cached as attention KV, but no state checkpoint reached them
    num_preemptions: int  # cumulative
    num_scheduled_tokens: int  # this step
    prefix_cache_tier_hits: int = 0  # cumulative, of prefix_cache_hits: prompt tokens a second tier supplied
    kv_offload: OffloadStats | None = None  # the second tier's counters, per tier (None without one)
    speculation: SpeculationStats | None = None  # cumulative; None without speculative decoding
    # per group of a draft model's or MTP head's own KV cache (drawn from the same budget as kv_usage's);
    # None without one
    proposer_kv_usage: list[float] | None = None
