"""One step's sampling inputs: a SamplingRow per request, batched into a SamplingBatch of tensors.

A batch is built on the host every step and moved to the device in one packed copy
(metadata.to_device). A request with nothing but a temperature and filters (SamplingRow.plain)
skips every per-row check, and a filter's tensor is None when no sampled row uses it, so the
sampler skips that stage. What the sampler does with a batch: worker/sampler.py.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from blockserve.attention.metadata import int64_tensor, to_device
from blockserve.sampling_params import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # below this a row is sampled greedily (as vLLM does)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator a seeded request keeps for its whole life and passes to every step, on the
    engine's device."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class TokenConstraint(Protocol):
    """What constrains a row to a grammar (structured/matcher.py's GrammarMatcher)."""

    num_words: int  # int32 words in one bitmask row: ceil(vocab / 32)

    def fill_bitmask(self, row: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one request this step. `generator` is required when
    `params.seed` is set (create it once with `make_generator(params.seed, device)`)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    eos_token_id: int | None = None  # blocked, with the stop token ids, until min_tokens are out
    grammar: TokenConstraint | None = None  # structured outputs: the tokens allowed next
    # Speculative decoding with a sampled draft: (the draft token this row verifies, the distribution [V]
    # the draft was drawn from). The row then emits the draft with probability min(1, p/q) at it, else a
    # token of the residual max(0, p - q) normalised (worker/sampler.py); None: an ordinary row.
    draft: tuple[int, torch.Tensor] | None = None
    # True when only the temperature and the filters matter: no seed or generator, logprobs, penalty,
    # bias, grammar or min_tokens. The runner keeps a request's row for its life, so this is worked out once.
    plain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.params
        object.__setattr__(self, "plain", p.seed is None and self.generator is None and p.logprobs is None
                           and not has_penalty(p) and not p.logit_bias and self.grammar is None
                           and p.min_tokens == 0 and self.draft is None)

    def blocked_ids(self) -> tuple[int, ...]:
        """Tokens that may not be sampled yet: they would stop the request before min_tokens."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return ()
        eos = () if self.eos_token_id is None or self.params.ignore_eos else (self.eos_token_id,)
        return eos + self.params.stop_token_ids


@dataclass(frozen=True)
class Penalties:
    """The repetition, frequency and presence penalties of the batch's rows that set one."""

    rows: torch.Tensor  # [P] rows of the batch that have a penalty
    repetition: torch.Tensor  # [P, 1] float, 1.0 = off
    frequency: torch.Tensor  # [P, 1] float, 0.0 = off
    presence: torch.Tensor  # [P, 1] float, 0.0 = off
    seen_ids: torch.Tensor  # [P, L] prompt + output token ids (repetition rows only), padded with -1
    output_ids: torch.Tensor  # [P, L'] output token ids, padded with -1
    max_token: int  # the largest id in seen_ids and output_ids (-1: none), read before they leave the host


@dataclass(frozen=True)
class DraftRows:
    """The rows of a batch that verify a sampled draft (SamplingRow.draft), D of them."""

    rows: torch.Tensor  # [D] long: their rows in the batch
    sampled_index: torch.Tensor  # [D] long: their index among the sampled rows
    tokens: torch.Tensor  # [D] long: the draft tokens
    distributions: torch.Tensor  # [D, V] float: the distributions the drafts were drawn from
    generators: tuple[torch.Generator | None, ...]  # [D] a seeded request's generator, else None


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling parameters as tensors; build with `SamplingBatch.build(rows, device)`
    (made on the host, then moved to `device` from pinned memory, the int64 ones in one copy).

    Tensors named per sampled row have one entry per row in `sampled_rows` (the non-greedy rows).
    A filter's tensor is None when no sampled row uses that filter.
    """

    num_rows: int
    device: torch.device
    sampled_rows: torch.Tensor | None  # [M] long; None when every row is sampled (M = N) or none is (M = 0)
    num_sampled: int
    temperature: torch.Tensor | None  # [M]; None when no row is sampled
    top_k: torch.Tensor | None  # [M] long, 0 = off
    max_top_k: int
    top_p: torch.Tensor | None  # [M], 1.0 = off
    min_p: torch.Tensor | None  # [M], 0.0 = off
    seeded: tuple[tuple[int, torch.Generator], ...]  # (index among sampled rows, generator)
    unseeded: torch.Tensor | None  # [U] indices among sampled rows that share the sampler's generator
    penalties: Penalties | None
    logprob_rows: torch.Tensor | None  # [R] rows that asked for logprobs; None when none did
    logprob_counts: tuple[int, ...]  # [R] their params.logprobs (top n)
    logprob_row_ids: tuple[int, ...]  # [R] logprob_rows on the host (reading the tensor would wait for the device)
    # Token ids masked out this step (min_tokens): (rows, ids) pairs of the unconstrained rows as tensors,
    # and per constrained row (row, ids), whose grammar may allow nothing else (then it wins).
    blocked_index: tuple[torch.Tensor, torch.Tensor] | None
    blocked: tuple[tuple[int, tuple[int, ...]], ...]
    grammars: tuple[tuple[int, TokenConstraint], ...] = ()  # (row, its grammar): constrained rows only
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, biases
    # The largest token id logit_bias names (-1: none), checked against the vocabulary on the host:
    # reading the tensor would wait for the device.
    max_bias_token: int = -1
    drafts: DraftRows | None = None  # rows that verify sampled drafts; None: none

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device | str) -> SamplingBatch:
        if not rows:
            raise ValueError("a SamplingBatch needs at least one row")
        device = canonical_device(device)
        special = [i for i, row in enumerate(rows) if not row.plain]  # the only rows that can need more
        for i in special:
            row = rows[i]
            if row.params.seed is not None and row.generator is None:
                raise ValueError(
                    f"row {i} has seed {row.params.seed} but no generator: keep "
                    f"make_generator(params.seed, device) with the request and pass it every step"
                )
            if row.generator is not None and canonical_device(row.generator.device) != device:
                raise ValueError(f"row {i}'s generator is on {row.generator.device}, the batch on {device}")
        sampled = [i for i, row in enumerate(rows) if row.params.temperature >= GREEDY_TEMPERATURE]
        params = [rows[i].params for i in sampled]
        host = torch.device("cpu")

        def floats(values):  # through an array, as int64_tensor: this runs every step
            return torch.frombuffer(array("f", values), dtype=torch.float32)

        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        seeded = tuple((j, rows[i].generator) for j, i in enumerate(sampled) if rows[i].generator is not None)
        seeded_ids = {j for j, _ in seeded}
        unseeded = [j for j in range(len(sampled)) if j not in seeded_ids] if seeded else []
        logprob_rows = [i for i in special if rows[i].params.logprobs is not None]
        batch = cls(
            num_rows=len(rows),
            device=host,
            sampled_rows=int64_tensor(sampled) if 0 < len(sampled) < len(rows) else None,
            num_sampled=len(sampled),
            temperature=floats([p.temperature for p in params]) if sampled else None,
            top_k=int64_tensor(top_k) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_p=floats([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            min_p=floats([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            seeded=seeded,
            unseeded=int64_tensor(unseeded) if seeded and unseeded else None,
            penalties=_build_penalties(rows, special),
            logprob_rows=torch.tensor(logprob_rows, dtype=torch.long) if logprob_rows else None,
            logprob_counts=tuple(rows[i].params.logprobs for i in logprob_rows),
            logprob_row_ids=tuple(logprob_rows),
            blocked_index=_build_blocked_index(rows, special),
            blocked=tuple((i, ids) for i in special if rows[i].grammar is not None and (ids := rows[i].blocked_ids())),
            grammars=tuple((i, rows[i].grammar) for i in special if rows[i].grammar is not None),
            logit_bias=_build_logit_bias(rows, special),
            max_bias_token=max((t for i in special for t, _ in rows[i].params.logit_bias), default=-1),
            drafts=_build_drafts(rows, special, sampled, device),
        )
        return batch if device == host else batch.to(device)

    def to(self, device: torch.device) -> SamplingBatch:
        """This batch with its tensors on `device` (metadata.to_device: one packed copy of the int64
        ones, pinned and non-blocking)."""
        tensors = {name: getattr(self, name) for name in _TENSOR_FIELDS}
        if self.penalties is not None:  # (dataclasses.asdict would deep-copy the tensors)
            tensors["penalties"] = {f.name: getattr(self.penalties, f.name) for f in dataclasses.fields(Penalties)}
        drafts = self.drafts
        if drafts is not None:  # (their distributions are on the device already: the draft's runner made them there)
            tensors["drafts"] = (drafts.rows, drafts.sampled_index, drafts.tokens)
        moved = to_device(tensors, device)
        if self.penalties is not None:
            moved["penalties"] = Penalties(**moved["penalties"])
        if drafts is not None:
            rows, sampled_index, tokens = moved["drafts"]
            moved["drafts"] = DraftRows(rows, sampled_index, tokens, drafts.distributions, drafts.generators)
        return dataclasses.replace(self, device=device, **moved)


_TENSOR_FIELDS = ("sampled_rows", "temperature", "top_k", "top_p", "min_p", "unseeded", "penalties", "logprob_rows",
                  "logit_bias", "blocked_index")


def canonical_device(device: torch.device | str) -> torch.device:
    """The device with its index filled in ("cuda" -> "cuda:0"), so comparisons mean what they say."""
    if isinstance(device, torch.device) and (device.index is None) == (device.type == "cpu"):
        return device  # already canonical (asked every step: no tensor made to find out)
    return torch.empty(0, device=device).device


def _build_drafts(rows: Sequence[SamplingRow], special: list[int], sampled: list[int],
                  device: torch.device) -> DraftRows | None:
    """The rows verifying sampled drafts; a greedy one is refused (a greedy request verifies its drafts by
    equality with the target's argmax: the runner gives it no draft distribution)."""
    chosen = [i for i in special if rows[i].draft is not None]
    if not chosen:
        return None
    among = {i: j for j, i in enumerate(sampled)}
    greedy = [i for i in chosen if i not in among]
    if greedy:
        raise ValueError(f"row {greedy[0]} verifies a sampled draft but is greedy (temperature "
                         f"{rows[greedy[0]].params.temperature}): give drafts a distribution only at temperature > 0")
    distributions = torch.stack([rows[i].draft[1] for i in chosen]).to(device=device, dtype=torch.float32)
    return DraftRows(int64_tensor(chosen), int64_tensor([among[i] for i in chosen]),
                     int64_tensor([rows[i].draft[0] for i in chosen]), distributions,
                     tuple(rows[i].generator for i in chosen))


def _build_logit_bias(rows: Sequence[SamplingRow], special: list[int]):
    pairs = [(i, token, bias) for i in special for token, bias in rows[i].params.logit_bias]
    if not pairs:
        return None
    rows_, tokens, biases = zip(*pairs)
    return (torch.tensor(rows_, dtype=torch.long), torch.tensor(tokens, dtype=torch.long),
            torch.tensor(biases, dtype=torch.float32))


def _build_blocked_index(rows: Sequence[SamplingRow], special: list[int]):
    """(rows, token ids) of the unconstrained rows' blocked tokens (SamplingRow.blocked_ids); None: none."""
    pairs = [(i, token) for i in special if rows[i].grammar is None for token in rows[i].blocked_ids()]
    if not pairs:
        return None
    rows_, tokens = zip(*pairs)
    return torch.tensor(rows_, dtype=torch.long), torch.tensor(tokens, dtype=torch.long)


def has_penalty(p: SamplingParams) -> bool:
    """Whether `p` sets a penalty (sampling then reads the values of the output tokens so far)."""
    return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def _padded(seqs: list[list[int]]) -> torch.Tensor:
    width = max(map(len, seqs), default=0)
    return torch.tensor([s + [-1] * (width - len(s)) for s in seqs], dtype=torch.long)


def _build_penalties(rows: Sequence[SamplingRow], special: list[int]) -> Penalties | None:
    chosen = [i for i in special if has_penalty(rows[i].params)]
    if not chosen:
        return None
    ps = [rows[i].params for i in chosen]
    outputs = [list(rows[i].output_token_ids) for i in chosen]
    seen = [list(rows[i].prompt_token_ids) + out if p.repetition_penalty != 1 else [] for i, out, p in zip(chosen, outputs, ps)]

    def column(values):
        return torch.tensor(values, dtype=torch.float32).unsqueeze(1)

    seen_ids, output_ids = _padded(seen), _padded(outputs)
    return Penalties(
        rows=torch.tensor(chosen, dtype=torch.long),
        repetition=column([p.repetition_penalty for p in ps]),
        frequency=column([p.frequency_penalty for p in ps]),
        presence=column([p.presence_penalty for p in ps]),
        seen_ids=seen_ids,
        output_ids=output_ids,
        max_token=max((int(ids.max()) for ids in (seen_ids, output_ids) if ids.numel()), default=-1),
    )
