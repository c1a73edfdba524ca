"""SpeculativeConfig: what `--speculative-config` (vLLM's JSON shape) asks for, validated at start-up.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

    {"method": "draft_model", "model": "path/to/small-model", "num_speculative_tokens": 4}

    {"method": "mtp", "num_speculative_tokens": 2}

Every error names the field and what to give instead. Methods other than n-gram prompt lookup,
suffix decoding, a draft model and the checkpoint's multi-token-prediction layer (eagle, medusa,
...) are refused by name: they are not built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model", "mtp")
NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "ngram_gpu")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both ends of the window
# Each method's own fields (vLLM's names and defaults); giving one to the other method is refused.
NGRAM_FIELDS = {"prompt_lookup_min": DEFAULT_PROMPT_LOOKUP, "prompt_lookup_max": DEFAULT_PROMPT_LOOKUP}
SUFFIX_FIELDS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                 "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}


@dataclass(frozen=True)
class SpeculativeConfig:
    """`ngram`, prompt lookup: the last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
    are looked up in the request's prompt and output so far; the up to `num_speculative_tokens`
    tokens that followed their latest earlier occurrence are proposed.

    `suffix`, suffix decoding (spec_decode/suffix.py): the most frequent continuation of the longest
    match (at most suffix_decoding_max_tree_depth - 1 tokens) of the request's last tokens in its own
    tokens and in the outputs of the last suffix_decoding_max_cached_requests finished requests
    (0: its own only); at most suffix_decoding_max_spec_factor x the match length tokens, each at
    least suffix_decoding_min_token_prob of the continuations seen.

    `draft_model`: `model` (a model directory or .gguf file with the target's vocabulary) decodes
    the drafts, greedy or sampled as the request samples (worker/draft_proposer.py); it takes none of
    the other methods' fields.

    `mtp`: the target checkpoint's own multi-token-prediction layer (DeepSeek-V3, Qwen3-Next) decodes
    the drafts, greedy or sampled, from the target's hidden states (worker/mtp_proposer.py); it takes
    no other method's fields.

    `disable_by_batch_size`: no proposals in a step with at least this many running requests
    (None: no limit). Below it, drafts are verified only where the measured cost of the rows they
    add is expected to pay (spec_decode/step_costs.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = SUFFIX_FIELDS["suffix_decoding_max_tree_depth"]
    suffix_decoding_max_cached_requests: int = SUFFIX_FIELDS["suffix_decoding_max_cached_requests"]
    suffix_decoding_max_spec_factor: float = SUFFIX_FIELDS["suffix_decoding_max_spec_factor"]
    suffix_decoding_min_token_prob: float = SUFFIX_FIELDS["suffix_decoding_min_token_prob"]

    def __post_init__(self) -> None:
        if self.method in NOT_BUILT:
            raise ValueError(f"speculative_config.method {self.method!r} is not supported by this engine; "
                             f"use one of {list(METHODS)}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is unknown; use one of {list(METHODS)}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model is required by the 'draft_model' method: give the path "
                                 "of a small model (directory or .gguf) with the target's vocabulary")
        elif self.model is not None:
            raise ValueError(f"speculative_config.model is for the 'draft_model' method; the {self.method!r} "
                             "method takes no model: leave it out")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, None)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, None)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max}); give min <= max")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        other = {"ngram": SUFFIX_FIELDS, "suffix": NGRAM_FIELDS, "draft_model": NGRAM_FIELDS | SUFFIX_FIELDS,
                 "mtp": NGRAM_FIELDS | SUFFIX_FIELDS}
        for name, default in other[self.method].items():
            if getattr(self, name) != default:
                raise ValueError(f"speculative_config.{name} is not a field of the {self.method!r} method; leave it out")
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 2, None)
        _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0, None)
        _check_number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0, None)
        _check_number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0, 1)

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from itself, a mapping, or a JSON object string (the command line's form); None
        stays None. Unknown fields are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}); give an object such as "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known fields are {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config.method is required; use one of {list(METHODS)}")
        return cls(**value)


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config.{name} must be an integer {bound}, got {value!r}")


def _check_number(name: str, value: Any, low: float, high: float | None) -> None:
    """A number above `low` (and at most `high`)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low
            or (high is not None and value > high)):
        bound = f"in ({low}, {high}]" if high is not None else f"> {low}"
        raise ValueError(f"speculative_config.{name} must be a number {bound}, got {value!r}")
