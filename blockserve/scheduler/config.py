"""Scheduler limits, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step
    enable_chunked_prefill: bool = True
    max_prefill_chunk: int | None = None  # per-request cap on prompt tokens per step; None: the budget
    policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be at least 1, got {self.max_prefill_chunk}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be at least max_model_len ({self.max_model_len})"
            )

    @property
    def chunk_cap(self) -> int:
        """The most tokens one request computes in one step."""
        if not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return min(self.max_num_batched_tokens, self.max_prefill_chunk or self.max_num_batched_tokens)
