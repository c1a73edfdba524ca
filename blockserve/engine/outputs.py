"""What the offline API returns, with vLLM's names: one RequestOutput per prompt, one
CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None  # 1 = the most likely; None when the sampled token is outside the top n
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per token: sampled and top-n

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = False
    # SamplingParams.prompt_logprobs: per prompt token, its logprob and the top n (vLLM's shape:
    # the first is None, nothing precedes it); set once the prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
