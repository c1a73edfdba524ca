"""How a request's tokens are chosen and when its generation stops.

Validated once, at construction, with messages a caller can act on. Pure Python: the
scheduler reads the stop conditions, the worker's sampler the rest.
"""

from __future__ import annotations

import json as _json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, vLLM's shape: exactly one kind is set.

    - json: a JSON schema (a dict, or its text); the output is JSON valid against it
    - regex: the output matches this regular expression (Rust `regex` syntax)
    - choice: the output is exactly one of these strings
    - grammar: a context-free grammar, in Lark syntax or llama.cpp's GBNF
    - json_object: True: the output is some JSON object

    `compiled` is the engine's: it is set when the request is added (never by the caller) and is
    left out of equality, hashing and repr.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", _json.dumps(self.json))
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its text): {e}") from None
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise ValueError("structured_outputs.choice must list at least one string")
        if self.json_object is False:
            object.__setattr__(self, "json_object", None)
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name) is not None]
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar or json_object; "
                             f"got {', '.join(kinds) if kinds else 'none'}")
        if self.json is not None:
            try:
                schema = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema: an object (or true/false)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) is not None)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token, besides the sampled one's
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token, besides its own (worker/prompt_logprobs.py)
    # token id -> bias added to its logit before sampling, in [-100, 100]; kept as sorted (id, bias) pairs
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True  # False: the text keeps them (a chat format that speaks in them: harmony)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0 or self.top_k == -1, f"top_k must be 0 (or -1) to disable, or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias keys must be non-negative token ids"),
            (
                all(-LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT for _, b in self.logit_bias),
                f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
            ),
            (
                self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs must be a StructuredOutputsParams",
            ),
            (
                self.structured_outputs is None or not self.ignore_eos,
                "ignore_eos cannot be combined with structured_outputs: the grammar's end is where the output stops",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
