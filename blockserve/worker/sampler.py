"""Batched sampling: one token per row of logits [N, V], each row under its own SamplingParams
(one step's rows as a SamplingBatch: worker/sampling_batch.py).

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
  a seed draws its u from its own generator (`make_generator`), so its samples do not depend on
  what else is in the batch; the other rows share the sampler's generator. On the CPU the filters
  and the draw are one native call (csrc/sample.cpp: selection by histograms, no sort, no OpenMP
  region); elsewhere the PyTorch ops below, with the same thresholds and the same draw up to float
  rounding.
- Sampled drafts (speculative decoding, SamplingBatch.drafts): a row verifying a draft x drawn from
  q emits x with probability min(1, p(x) / q(x)), p being the distribution the row samples from
  (after every stage above), else a draw from max(0, p - q) normalised: its token is distributed as
  p. p is computed by the PyTorch filters; the acceptance draws one more uniform number per row.
  `keep_distributions` (a sampling draft's runner) draws every sampled row from the PyTorch
  filters' distribution and returns it with the tokens.
- Logprobs are the log-softmax of the logits after penalties and before temperature and the
  filters (the sampled token's, and the top n = params.logprobs). This differs from vLLM v1's
  default ("raw_logprobs"), which is taken before penalties too; with no penalty set they agree.

Only the per-row draws from seeded generators loop in Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from blockserve.native.extension import fused_ops
from blockserve.native.gate import native_reads
from blockserve.worker.sampling_batch import DraftRows, Penalties, SamplingBatch, TokenConstraint, canonical_device

_TOP_P_FIRST_K = 256  # top-p first looks for each row's nucleus among this many tokens


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
    distributions: torch.Tensor | None = None  # [N, V] what each row drew from (keep_distributions), on the device

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
        self.device = canonical_device(device)
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

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, keep_distributions: bool = False) -> SampledTokens:
        """The samples as tensors on the device, without waiting for it; with `keep_distributions`, also
        the distribution each row's token was drawn from (a sampling draft's, for its verification) when
        any row samples (None for an all-greedy batch, whose drafts no verification weighs)."""
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
        uniforms = self._uniforms(batch) if batch.num_sampled else None
        distributions = None
        if keep_distributions and batch.num_sampled:  # greedy drafts' distributions are never read
            tokens, distributions = self._sample_keeping(logits, batch, uniforms)
        elif batch.num_sampled == batch.num_rows:
            tokens = self._sample(logits, batch, uniforms)
        else:
            tokens = self._argmax(logits)
            if batch.num_sampled:
                tokens[batch.sampled_rows] = self._sample(logits[batch.sampled_rows], batch, uniforms)
        if batch.drafts is not None:
            tokens = self._judge_drafts(logits, batch, tokens.long(), uniforms)
        return _with_logprobs(SampledTokens(tokens.long(), distributions=distributions), logits, batch)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, uniforms: torch.Tensor) -> torch.Tensor:
        """Tokens for the sampled rows (logits [M, V], already penalised)."""
        if self.native is not None and native_reads(logits) and logits.stride(-1) == 1:
            return self.native.sample_rows(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, uniforms)
        return _inverse_cdf(self._filtered(logits, batch), uniforms)

    def _filtered(self, logits: torch.Tensor, batch: SamplingBatch, among: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled rows' logits [M, V] over their temperature, the filters' dropped tokens at -inf (`among`:
        the rows' indices among the sampled rows, when `logits` holds only some). The filters work in place
        on z, a fresh tensor."""
        def pick(values):
            return values if among is None else values[among]

        z = logits / pick(batch.temperature).unsqueeze(1)
        if batch.top_k is not None:
            z = _top_k(z, pick(batch.top_k), batch.max_top_k)
        if batch.top_p is not None:
            z = _top_p(z, pick(batch.top_p), self.reads_back)
        if batch.min_p is not None:
            z = _min_p(z, pick(batch.min_p))
        return z

    def _sample_keeping(self, logits: torch.Tensor, batch: SamplingBatch,
                        uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's token and the distribution [N, V] it was drawn from (a greedy row's: all mass on
        its argmax). The sampled rows draw from exactly that distribution, by inverse CDF."""
        tokens = self._argmax(logits)
        distributions = torch.zeros_like(logits).scatter_(1, tokens.long().unsqueeze(1), 1.0)
        if batch.num_sampled:
            rows = batch.sampled_rows
            probs = torch.softmax(self._filtered(logits if rows is None else logits[rows], batch), dim=-1)
            drawn = _draw(probs, uniforms, tokens if rows is None else tokens[rows])
            if rows is None:
                tokens, distributions = drawn, probs
            else:
                tokens[rows], distributions[rows] = drawn.to(tokens.dtype), probs
        return tokens, distributions

    def _judge_drafts(self, logits: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor,
                      uniforms: torch.Tensor) -> torch.Tensor:
        """Rejection sampling of the sampled drafts (Leviathan et al. 2023; Chen et al. 2023): at a row
        whose target distribution is p and whose draft x was drawn from q, the row's token is x with
        probability min(1, p(x) / q(x)), else a draw from max(0, p - q) normalised (from p where that is
        all 0, which happens only where p = q up to rounding). Either way the token is distributed
        as p. The row's own uniform draws the residual; the acceptance draws one more."""
        drafts = batch.drafts
        p = torch.softmax(self._filtered(logits[drafts.rows], batch, drafts.sampled_index), dim=-1)
        q = drafts.distributions
        if q.shape != p.shape:
            raise ValueError(f"the draft distributions have shape {tuple(q.shape)}, the target's {tuple(p.shape)}: "
                             "a draft must share the target's vocabulary")
        x = drafts.tokens.unsqueeze(1)
        accepted = self._acceptance_uniforms(drafts) * q.gather(1, x).squeeze(1).double() \
            < p.gather(1, x).squeeze(1).double()
        residual = (p - q).clamp_(min=0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
        recovered = _draw(residual, uniforms[drafts.sampled_index], tokens[drafts.rows])
        tokens[drafts.rows] = torch.where(accepted, drafts.tokens, recovered)
        return tokens

    def _acceptance_uniforms(self, drafts: DraftRows) -> torch.Tensor:
        """One number in [0, 1) per draft row, float64: a seeded request's from its own generator (after
        the step's draws for its rows), the others' in one block from the sampler's."""
        uniforms = torch.empty(len(drafts.generators), dtype=torch.float64, device=self.device)
        shared = [i for i, generator in enumerate(drafts.generators) if generator is None]
        if len(shared) == len(drafts.generators):
            return uniforms.uniform_(generator=self.generator)
        if shared:
            block = torch.empty(len(shared), dtype=torch.float64, device=self.device)
            uniforms[torch.tensor(shared, device=self.device)] = block.uniform_(generator=self.generator)
        for i, generator in enumerate(drafts.generators):
            if generator is not None:
                uniforms[i : i + 1].uniform_(generator=generator)
        return uniforms

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row argmax of x [N, V], ties to the lowest index (NaN wins, as in torch): the native
        argmax_rows on the CPU (native/csrc/argmax.cpp: no OpenMP region), else `max(dim).indices`,
        the same answer as `argmax` and faster on the CPU (measured in docs/performance.md)."""
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
    return _draw(torch.softmax(z, dim=-1), uniforms, z.max(dim=-1).indices)


def _draw(weights: torch.Tensor, uniforms: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Per row of weights [M, V] (>= 0), the first token at which their cumulative sum passes u times
    its total; a row whose total is NaN gets its `fallback` token."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return torch.where(total.squeeze(1).isnan(), fallback, tokens)


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


def _apply_penalties(logits: torch.Tensor, penalties: Penalties | None) -> torch.Tensor:
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
