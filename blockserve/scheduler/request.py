"""A request as the scheduler sees it, and its lifecycle.

    WAITING ──admit──► RUNNING ──stop / length──► FINISHED_STOPPED / FINISHED_LENGTH
       ▲                  │
       └──── PREEMPTED ◄──┘ (all blocks freed; recomputed from scratch on re-admission)

    any state ──abort──► FINISHED_ABORTED        add_request ──invalid──► FINISHED_REJECTED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from blockserve.errors import RequestRejected  # re-exported: the scheduler's public error
from blockserve.kv.hashing import BlockHashChain
from blockserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "rejected")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0  # lower is served first (as in vLLM)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids: list[int] = list(self.prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0  # tokens whose KV is (or is being) written
        # Tokens a scheduled step will sample that have not come back yet: they count as the request's
        # own when scheduling (their input ids are filled in on the device), not in token_ids.
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: BlockHashChain | None = None  # set by the scheduler on add
        self.order_key: tuple = ()  # policy order, unique; set by the scheduler on add
        self.max_output_tokens = 0  # max_tokens, or what max_model_len leaves; set by the scheduler
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.state_lost_tokens = 0  # tokens cached as attention KV but not as a state checkpoint, then
        self.num_preemptions = 0
        self.stop_reason: int | None = None  # the stop token that ended it, if any
        self.error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens
