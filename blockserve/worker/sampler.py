"""Batched sampling: one token per row of logits [N, V], each row under its own SamplingParams.

    logits ─► grammar mask ─► logit_bias ─► penalties ─┬─► log_softmax ─► TokenLogprobs (rows that asked)
                                                       ├─► argmax ─────────────────────────────────────► greedy rows
                                                       └─► / temperature ─► top-k ─► top-p ─► min-p ─► inverse CDF(u) ─► sampled rows

- Greedy: a temperature below GREEDY_TEMPERATURE (0 included) is argmax of the penalised logits,
  exactly what Hugging Face greedy search picks (ties go to the lowest id).
- Grammar (structured outputs): a constrained row's `grammar` fills an int32 bitmask (bit j of
  word w allows token 32w + j); the tokens it forbids get -inf before anything else, so every
  later stage (and the logprobs) sees only what the grammar allows. Unconstrained rows skip it.
- logit_bias: (token id, bias) pairs added to the row's logits, before the penalties (OpenAI).
- Penalties: repetition (HF: over prompt and output tokens, positive logits divided, negative
  ones multiplied), then frequency and presence (OpenAI: over output tokens, subtracted).
- min_tokens: until a row has that many output tokens, its EOS (unless ignore_eos) and stop
  token ids are masked out, as vLLM does, so the request cannot stop early. On a constrained row
  the grammar wins: when the grammar allows only tokens min_tokens blocks (it is complete and
  forces EOS), they are not blocked, and the request ends as the grammar says.
- Filters follow HF and vLLM: top-k keeps every token at least as likely as the k-th (ties
  kept; 0 or -1 is off); top-p keeps the most likely tokens until their mass reaches top_p,
  measured after top-k; min-p drops tokens whose probability is below min_p times the top one's.
  Each filter stage runs as one batched op, and is skipped when no row uses it.
- Sampling is by inverse CDF: one uniform number u per row, and the first token, in id order, at
  which the kept tokens' cumulative probability passes u (times their sum). A row whose request has
  a seed draws its u from its own generator (see `make_generator`), so its samples do not depend on
  what else is in the batch; the other rows share the sampler's generator. On the CPU the filters
  and the draw are one native call (csrc/sample.cpp: selection by histograms, no sort, no OpenMP
  region); elsewhere the PyTorch ops below, with the same thresholds and the same draw up to float
  rounding.
- Logprobs are the log-softmax of the logits after penalties and before temperature and the
  filters (the sampled token's, and the top n = params.logprobs). This differs from vLLM v1's
  default ("raw_logprobs"), which is taken before penalties too; with no penalty set they agree.

Only the per-row draws from seeded generators loop in Python.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from blockserve.attention.metadata import int64_tensor, to_device
from blockserve.native.extension import fused_ops
from blockserve.native.gate import native_reads
from blockserve.sampling_params import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # below this a row is sampled greedily (as vLLM does)
_TOP_P_FIRST_K = 256  # top-p first looks for each row's nucleus among this many tokens


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
    # True when only the temperature and the filters matter: no seed or generator, logprobs, penalty,
    # bias, grammar or min_tokens. The runner keeps a request's row for its life, so this is worked out once.
    plain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.params
        object.__setattr__(self, "plain", p.seed is None and self.generator is None and p.logprobs is None
                           and not has_penalty(p) and not p.logit_bias and self.grammar is None
                           and p.min_tokens == 0)

    def blocked_ids(self) -> tuple[int, ...]:
        """Tokens that may not be sampled yet: they would stop the request before min_tokens."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return ()
        eos = () if self.eos_token_id is None or self.params.ignore_eos else (self.eos_token_id,)
        return eos + self.params.stop_token_ids


@dataclass(frozen=True)
class _Penalties:
    rows: torch.Tensor  # [P] rows of the batch that have a penalty
    repetition: torch.Tensor  # [P, 1] float, 1.0 = off
    frequency: torch.Tensor  # [P, 1] float, 0.0 = off
    presence: torch.Tensor  # [P, 1] float, 0.0 = off
    seen_ids: torch.Tensor  # [P, L] prompt + output token ids (repetition rows only), padded with -1
    output_ids: torch.Tensor  # [P, L'] output token ids, padded with -1
    max_token: int  # the largest id in seen_ids and output_ids (-1: none), read before they leave the host


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
    penalties: _Penalties | None
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

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device | str) -> SamplingBatch:
        if not rows:
            raise ValueError("a SamplingBatch needs at least one row")
        device = _canonical(device)
        special = [i for i, row in enumerate(rows) if not row.plain]  # the only rows that can need more
        for i in special:
            row = rows[i]
            if row.params.seed is not None and row.generator is None:
                raise ValueError(
                    f"row {i} has seed {row.params.seed} but no generator: keep "
                    f"make_generator(params.seed, device) with the request and pass it every step"
                )
            if row.generator is not None and _canonical(row.generator.device) != device:
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
        )
        return batch if device == host else batch.to(device)

    def to(self, device: torch.device) -> SamplingBatch:
        """This batch with its tensors on `device` (metadata.to_device: one packed copy of the int64
        ones, pinned and non-blocking)."""
        tensors = {name: getattr(self, name) for name in _TENSOR_FIELDS}
        if self.penalties is not None:  # (dataclasses.asdict would deep-copy the tensors)
            tensors["penalties"] = {f.name: getattr(self.penalties, f.name) for f in dataclasses.fields(_Penalties)}
        moved = to_device(tensors, device)
        if self.penalties is not None:
            moved["penalties"] = _Penalties(**moved["penalties"])
        return dataclasses.replace(self, device=device, **moved)


_TENSOR_FIELDS = ("sampled_rows", "temperature", "top_k", "top_p", "min_p", "unseeded", "penalties", "logprob_rows",
                  "logit_bias", "blocked_index")


def _canonical(device: torch.device | str) -> torch.device:
    """The device with its index filled in ("cuda" -> "cuda:0"), so comparisons mean what they say."""
    if isinstance(device, torch.device) and (device.index is None) == (device.type == "cpu"):
        return device  # already canonical (asked every step: no tensor made to find out)
    return torch.empty(0, device=device).device


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


def _build_penalties(rows: Sequence[SamplingRow], special: list[int]) -> _Penalties | None:
    chosen = [i for i in special if has_penalty(rows[i].params)]
    if not chosen:
        return None
    ps = [rows[i].params for i in chosen]
    outputs = [list(rows[i].output_token_ids) for i in chosen]
    seen = [list(rows[i].prompt_token_ids) + out if p.repetition_penalty != 1 else [] for i, out, p in zip(chosen, outputs, ps)]

    def column(values):
        return torch.tensor(values, dtype=torch.float32).unsqueeze(1)

    seen_ids, output_ids = _padded(seen), _padded(outputs)
    return _Penalties(
        rows=torch.tensor(chosen, dtype=torch.long),
        repetition=column([p.repetition_penalty for p in ps]),
        frequency=column([p.frequency_penalty for p in ps]),
        presence=column([p.presence_penalty for p in ps]),
        seen_ids=seen_ids,
        output_ids=output_ids,
        max_token=max((int(ids.max()) for ids in (seen_ids, output_ids) if ids.numel()), default=-1),
    )


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs for one sampled token: its own, and the top n (most likely first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # [N], one per row
    logprobs: list[TokenLogprobs | None]  # [N]; None where the row's params.logprobs is None


def copy_to_host_async(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """Copies of CUDA `tensors` (one device) in pinned host memory, begun without waiting for the
    device, and the event recorded after them: once it has happened, the copies hold the values."""
    moved = []
    for tensor in tensors:
        moved.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
        moved[-1].copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensors[0].device))
    return moved, ready


@dataclass(frozen=True)
class SampledTokens:
    """One step's samples as tensors, where the sampler made them: `token_ids` [N] (int64), and for
    the rows that asked (`logprob_row_ids`, top `logprob_counts`) the sampled token's logprob [R] and the
    top ones' ids and logprobs [R, n]. `to_host_async` starts their copy to the host; `host` reads them."""

    token_ids: torch.Tensor
    logprob_row_ids: tuple[int, ...] = ()
    logprob_counts: tuple[int, ...] = ()
    picked: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None  # set by to_host_async on CUDA: the host copies are done

    def to_host_async(self) -> SampledTokens:
        """These samples copied to pinned host memory without waiting for the device (on CUDA; on the
        CPU `self`): the device tensors stay usable, e.g. as the next step's input ids."""
        if self.token_ids.device.type == "cpu":
            return self
        names = [name for name in ("token_ids", "picked", "top_ids", "top_logprobs") if getattr(self, name) is not None]
        moved, ready = copy_to_host_async([getattr(self, name) for name in names])
        return dataclasses.replace(self, ready=ready, **dict(zip(names, moved)))

    def host(self) -> SamplerOutput:
        """The samples as lists (waits for the device when they are still being made or copied)."""
        if self.ready is not None:
            self.ready.synchronize()
        per_row: list[TokenLogprobs | None] = [None] * len(self.token_ids)
        if self.logprob_row_ids:
            picked, top_ids, top_lps = self.picked.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
            for k, (row, n) in enumerate(zip(self.logprob_row_ids, self.logprob_counts)):
                per_row[row] = TokenLogprobs(picked[k], top_ids[k][:n], top_lps[k][:n])
        return SamplerOutput(self.token_ids.tolist(), per_row)


class Sampler:
    """Samples one token per row. Holds the generator that rows without their own share."""

    def __init__(self, *, device: torch.device | str, seed: int | None = None):
        self.device = _canonical(device)
        self.native = fused_ops() if self.device.type == "cpu" else None  # its argmax_rows, where built
        # On the CPU reading a value back costs nothing; elsewhere it waits for the device, so nothing
        # does (async scheduling overlaps the host with the device).
        self.reads_back = self.device.type == "cpu"
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """The samples as lists: `sample(...).host()`."""
        return self.sample(logits, batch).host()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
        """The samples as tensors on the device, without waiting for it."""
        if batch.device != self.device:
            raise ValueError(f"the SamplingBatch was built for {batch.device}, the sampler is on {self.device}")
        _check_logits(logits, batch)
        vocab_size = logits.shape[1]
        if batch.max_bias_token >= vocab_size:
            raise ValueError(f"logit_bias token {batch.max_bias_token} is out of range for a vocabulary of {vocab_size}")
        if batch.penalties is not None and batch.penalties.max_token >= vocab_size:
            raise ValueError(f"token id {batch.penalties.max_token} is out of range for a vocabulary of {vocab_size}")
        logits = logits.float()
        owned = bool(batch.grammars) or batch.logit_bias is not None
        allowed = None
        if owned:  # never modify the caller's tensor
            logits = logits.clone()
            if batch.grammars:
                allowed = _apply_grammars(logits, batch.grammars)
            if batch.logit_bias is not None:
                rows, tokens, biases = batch.logit_bias
                logits.index_put_((rows, tokens), biases, accumulate=True)
        logits = _apply_penalties(logits, batch.penalties)
        if batch.blocked or batch.blocked_index is not None:
            logits = logits.clone() if batch.penalties is None and not owned else logits
            if batch.blocked_index is not None:
                logits[batch.blocked_index] = float("-inf")
            if batch.blocked:  # constrained rows: blocked unless the grammar allows only these (it wins)
                grammar_of = {row: i for i, (row, _) in enumerate(batch.grammars)}
                for row, ids in batch.blocked:
                    if not _allows_only(allowed[grammar_of[row]], ids):
                        logits[row, list(ids)] = float("-inf")
        if batch.num_sampled == batch.num_rows:
            tokens = self._sample(logits, batch)
        else:
            tokens = self._argmax(logits)
            if batch.num_sampled:
                tokens[batch.sampled_rows] = self._sample(logits[batch.sampled_rows], batch)
        return _with_logprobs(SampledTokens(tokens.long()), logits, batch)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Tokens for the sampled rows (logits [M, V], already penalised). The PyTorch filters work
        in place on z, a fresh tensor."""
        uniforms = self._uniforms(batch)
        if self.native is not None and native_reads(logits) and logits.stride(-1) == 1:
            return self.native.sample_rows(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, uniforms)
        z = logits / batch.temperature.unsqueeze(1)
        if batch.top_k is not None:
            z = _top_k(z, batch.top_k, batch.max_top_k)
        if batch.top_p is not None:
            z = _top_p(z, batch.top_p, self.reads_back)
        if batch.min_p is not None:
            z = _min_p(z, batch.min_p)
        return _inverse_cdf(z, uniforms)

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row argmax of x [N, V], ties to the lowest index (NaN wins, as in torch): the native
        argmax_rows on the CPU (csrc/argmax.cpp: no OpenMP region, ~7x faster at one row), else
        `max(dim).indices`, the same answer as `argmax` and ~1.5x faster on CPU at a 49k vocabulary."""
        if self.native is not None and native_reads(x) and x.stride(-1) == 1:
            return self.native.argmax_rows(x)
        return x.max(dim=-1).indices

    def _uniforms(self, batch: SamplingBatch) -> torch.Tensor:
        """One number in [0, 1) per sampled row, float64: a seeded row's from its own generator (one
        a step, whatever else is in the batch), the others' in one block from the sampler's."""
        uniforms = torch.empty(batch.num_sampled, dtype=torch.float64, device=self.device)
        if not batch.seeded:
            return uniforms.uniform_(generator=self.generator)
        if batch.unseeded is not None:
            block = torch.empty(len(batch.unseeded), dtype=torch.float64, device=self.device)
            uniforms[batch.unseeded] = block.uniform_(generator=self.generator)
        for j, generator in batch.seeded:
            uniforms[j : j + 1].uniform_(generator=generator)
        return uniforms


def _inverse_cdf(z: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of z [M, V] (filtered tokens at -inf), the first token at which the cumulative
    softmax passes u times its total; a row holding a NaN, or no finite z, gets argmax's answer."""
    cdf = torch.softmax(z, dim=-1).double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return torch.where(total.squeeze(1).isnan(), z.max(dim=-1).indices, tokens)


def _apply_grammars(logits: torch.Tensor, grammars: tuple[tuple[int, TokenConstraint], ...]) -> np.ndarray:
    """-inf, in place, at the tokens each constrained row's grammar forbids (columns past the
    grammar's vocabulary included); returns what each grammar allows, on the host ([len(grammars),
    covered columns] bool). The bits are unpacked by numpy (little-endian bytes: bit j of word w is
    token 32w + j) and each row is filled in place, which is several times cheaper on a CPU than
    unpacking with shifts and writing the rows back through an index."""
    vocab_size = logits.shape[1]
    words = max(g.num_words for _, g in grammars)
    bitmask = np.zeros((len(grammars), words), dtype=np.int32)
    rows = torch.from_numpy(bitmask)  # the same memory, as the grammars fill it
    for i, (_, grammar) in enumerate(grammars):
        grammar.fill_bitmask(rows[i, : grammar.num_words])
    covered = min(vocab_size, 32 * words)
    forbidden = np.unpackbits(np.invert(bitmask.view(np.uint8)), axis=1, count=covered, bitorder="little")
    allowed = ~forbidden.view(bool)
    forbidden = torch.from_numpy(forbidden).view(torch.bool).to(logits.device)
    for i, (row, _) in enumerate(grammars):
        logits[row, :covered].masked_fill_(forbidden[i], float("-inf"))
        if covered < vocab_size:
            logits[row, covered:] = float("-inf")
    return allowed


def _allows_only(allowed: np.ndarray, ids) -> bool:
    """Whether a grammar that allows `allowed` (one row of `_apply_grammars`') allows no token but `ids`."""
    return int(allowed.sum()) == sum(1 for t in set(ids) if t < allowed.shape[0] and allowed[t])


def _check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_rows, vocab_size], got shape {tuple(logits.shape)}")
    if logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits have {logits.shape[0]} rows but the SamplingBatch has {batch.num_rows}")
    if logits.shape[1] == 0:
        raise ValueError("logits have an empty vocabulary dimension")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.device != batch.device:
        raise ValueError(f"logits are on {logits.device} but the SamplingBatch was built for {batch.device}")


def _columns(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids (checked: < vocab_size) as column indices into a [P, V + 1] buffer: padding (-1) goes
    to the spare column V."""
    return torch.where(ids < 0, vocab_size, ids)


def _apply_penalties(logits: torch.Tensor, penalties: _Penalties | None) -> torch.Tensor:
    """A penalised copy of the logits. Work is per token id held, not per vocabulary entry:
    gather the logits of the ids, change them, scatter them back. A repeated id writes the
    same value each time, so each distinct token is penalised once (frequency: once per
    occurrence, through scatter_add)."""
    if penalties is None:
        return logits
    vocab_size = logits.shape[1]
    z = logits.new_zeros((len(penalties.rows), vocab_size + 1))
    z[:, :vocab_size] = logits[penalties.rows]
    seen = _columns(penalties.seen_ids, vocab_size)
    values = z.gather(1, seen)
    z.scatter_(1, seen, torch.where(values > 0, values / penalties.repetition, values * penalties.repetition))
    output = _columns(penalties.output_ids, vocab_size)
    z.scatter_add_(1, output, (-penalties.frequency).expand(output.shape))
    z.scatter_(1, output, z.gather(1, output) - penalties.presence)
    out = logits.clone()
    out[penalties.rows] = z[:, :vocab_size]
    return out


def _with_logprobs(sampled: SampledTokens, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
    """`sampled` with, for the rows that asked, the log-softmax of `logits` at the sampled token and at
    the top n."""
    if batch.logprob_rows is None:
        return sampled
    lp = torch.log_softmax(logits[batch.logprob_rows], dim=-1)
    picked = lp.gather(1, sampled.token_ids[batch.logprob_rows].unsqueeze(1)).squeeze(1)
    top = lp.topk(min(max(batch.logprob_counts), lp.shape[1]), dim=-1)
    return dataclasses.replace(sampled, logprob_row_ids=batch.logprob_row_ids, logprob_counts=batch.logprob_counts,
                               picked=picked, top_ids=top.indices, top_logprobs=top.values)


def _top_k(z: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep, per row with k > 0, the tokens at least as large as the k-th largest."""
    vocab_size = z.shape[1]
    top = z.topk(min(max_k, vocab_size), dim=-1).values
    kth = top.gather(1, (k.clamp(1, top.shape[1]) - 1).unsqueeze(1))
    threshold = torch.where(k.unsqueeze(1) > 0, kth, float("-inf"))
    return z.masked_fill_(z < threshold, float("-inf"))


def _top_p(z: torch.Tensor, p: torch.Tensor, reads_back: bool = True) -> torch.Tensor:
    """Keep, per row with p < 1, the most likely tokens until their probability reaches p (a
    token is kept when the tokens ranked above it hold less than p; ties with the last one kept
    are kept too). Every row's nucleus usually lies in its top _TOP_P_FIRST_K tokens, which saves
    sorting the whole vocabulary; when one does not, sort. Finding out reads a value back, so without
    `reads_back` (off the CPU) sort at once."""
    probs = z.softmax(dim=-1)
    p = p.unsqueeze(1)
    on = p < 1
    if reads_back:
        top = probs.topk(min(_TOP_P_FIRST_K, z.shape[1]), dim=-1).values
        mass = top.cumsum(dim=-1)
    if not reads_back or not bool(((mass[:, -1:] >= p) | ~on).all()):
        top = probs.sort(dim=-1, descending=True).values
        mass = top.cumsum(dim=-1)
    kept = (mass - top) < p  # the tokens ranked above hold less than p
    smallest_kept = top.masked_fill(~kept, float("inf")).min(dim=-1, keepdim=True).values
    return z.masked_fill_(on & (probs < smallest_kept), float("-inf"))


def _min_p(z: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability below min_p x the top probability: in log space,
    z < max(z) + log(min_p), so no softmax is needed (min_p = 0 gives -inf: keeps all)."""
    threshold = z.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)
    return z.masked_fill_(z < threshold, float("-inf"))
