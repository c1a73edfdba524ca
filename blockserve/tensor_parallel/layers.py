"""Tensor-parallel layers: each rank holds a slice of a weight, narrowed from the checkpoint as it loads.

    column-parallel   W [out, in]: this rank's rows        y_r = x W_rᵀ            (no communication)
                      fused layers shard each part: qkv = q heads | k heads | v heads,
                      gate_up = gate rows | up rows (the local parts, concatenated in that order)
    row-parallel      W [out, in]: this rank's columns     y = Σ_r x_r W_rᵀ + b    (one all-reduce)
    vocab-parallel    embedding rows [V/N, H] per rank     e = Σ_r (ids in range_r ? E_r[id] : 0)
                      LM head rows [V/N, H] per rank       logits gathered to rank 0 only
                      (V not divisible by N: each rank holds ceil(V/N) rows, the last padded with zeros)

KV heads: with N <= num_kv_heads each rank holds num_kv_heads / N of them; with N > num_kv_heads
(N a multiple of it) each rank holds one, shared by the N / num_kv_heads ranks whose query heads
attend to it (replicated), as a dense model's GQA groups q heads onto kv heads.

Recurrent layers (Qwen3-Next, Granite 4.0-H, Kimi Linear) shard by head the same way: their fused
in-projections are column-parallel with one slice per part (`sliced_column_linear`), their conv
weights and per-head vectors are narrowed as they load (`shard_on_load`), and Mamba2's B/C groups,
like KV heads, are replicated when N exceeds their number (`shared_head_slice`).

Each parameter carries `weight_loader(tensor, *, part, expert)` (models/weights.py): given a
full checkpoint tensor (of one part of a fused layer, or all parts) it returns a copy of this
rank's slice, so a rank never keeps the full weight. With no group (`tp` None) the factories return
the plain torch layers, so one device runs exactly the code it ran before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from blockserve.tensor_parallel.group import TensorParallelGroup


@dataclass(frozen=True)
class Slice:
    """Rows [start, start + size) of a checkpoint dimension of `full` rows."""

    full: int
    start: int
    size: int


def even_slice(full: int, tp: TensorParallelGroup, what: str) -> Slice:
    """This rank's 1/N of `full` rows; ValueError naming `what` unless N divides it."""
    if full % tp.size:
        raise ValueError(f"{what} = {full} is not divisible by tensor_parallel_size = {tp.size}")
    size = full // tp.size
    return Slice(full, tp.rank * size, size)


def kv_head_slice(num_kv_heads: int, head_dim: int, tp: TensorParallelGroup) -> Slice:
    """This rank's KV heads (rows of k or v): num_kv_heads / N of them, or one replicated head when
    N > num_kv_heads. ValueError unless one of the two divides the other."""
    return shared_head_slice(num_kv_heads, head_dim, tp, "num_key_value_heads")


def shared_head_slice(num_heads: int, head_rows: int, tp: TensorParallelGroup, what: str) -> Slice:
    """This rank's `num_heads / N` heads of `head_rows` rows each, or, when N > num_heads (a multiple
    of it), the one head it shares with the N / num_heads ranks next to it (replicated): KV heads,
    Mamba2's B/C groups. ValueError naming `what` unless one of the two divides the other."""
    if num_heads >= tp.size:
        return head_slice(num_heads, head_rows, tp, what)
    if tp.size % num_heads:
        raise ValueError(f"tensor_parallel_size = {tp.size} is neither a divisor nor a multiple of "
                         f"{what} = {num_heads}")
    head = tp.rank // (tp.size // num_heads)
    return Slice(num_heads * head_rows, head * head_rows, head_rows)


def head_slice(num_heads: int, head_rows: int, tp: TensorParallelGroup, what: str = "num_attention_heads") -> Slice:
    """This rank's num_heads / N heads of `head_rows` rows each; ValueError naming `what` unless N divides it."""
    heads = even_slice(num_heads, tp, what)
    return Slice(num_heads * head_rows, heads.start * head_rows, heads.size * head_rows)


def local_kv_heads(num_kv_heads: int, tp: TensorParallelGroup | None) -> int:
    return num_kv_heads if tp is None else max(1, num_kv_heads // tp.size)


def local_heads(num_heads: int, tp: TensorParallelGroup | None, what: str) -> int:
    """How many of `num_heads` this rank holds: all on one device, else num_heads / N (ValueError
    naming `what` unless N divides it)."""
    return num_heads if tp is None else even_slice(num_heads, tp, what).size


def shard_on_load(param: nn.Parameter, slices: Sequence[Slice] | None, dim: int = 0) -> nn.Parameter:
    """Give `param` (declared at this rank's shape) a `weight_loader` that takes this rank's rows of
    each of `slices` (the parts of a fused tensor, in order) along `dim` of a checkpoint tensor:
    conv weights, per-head vectors. `slices` None (one device): `param` as it is. Returns `param`."""
    if slices is not None:
        chosen = tuple(slices)
        param.weight_loader = lambda tensor, *, part, expert: _narrow_rows(tensor, chosen, part, dim, "parameter")
    return param


def _narrow_rows(tensor: torch.Tensor, slices: Sequence[Slice], part: int | None, dim: int, name: str) -> torch.Tensor:
    """A copy of this rank's rows of `tensor` along `dim`: of part `part`, or of every part when
    `tensor` holds them all, concatenated."""
    chosen = slices if part is None else [slices[part]]
    full = sum(s.full for s in chosen)
    if tensor.shape[dim] != full:
        raise ValueError(f"checkpoint tensor for {name} has {tensor.shape[dim]} rows along dim {dim}, "
                         f"the config says {full}; does config.json match the checkpoint?")
    pieces = tensor.split([s.full for s in chosen], dim=dim)
    return torch.cat([p.narrow(dim, s.start, s.size) for p, s in zip(pieces, chosen)], dim=dim)


class ColumnParallelLinear(nn.Linear):
    """y = x W_rᵀ (+ b_r): this rank's rows of each of `slices` (the parts of a fused weight, in order)."""

    def __init__(self, in_features: int, slices: Sequence[Slice], bias: bool):
        super().__init__(in_features, sum(s.size for s in slices), bias=bias)
        self.slices = tuple(slices)
        for param in self.parameters():
            param.weight_loader = self._narrow

    def _narrow(self, tensor: torch.Tensor, *, part: int | None, expert: int | None) -> torch.Tensor:
        return _narrow_rows(tensor, self.slices, part, 0, type(self).__name__)

    def narrow_blocks(self, raw: np.ndarray, block_bytes: int) -> np.ndarray:
        """This rank's rows of a GGUF weight's quantized blocks [out (all parts), in / 32 * block_bytes]:
        whole rows, so every block stays whole (models/quantized_linear.py)."""
        if raw.shape[0] != sum(s.full for s in self.slices):
            raise ValueError(f"GGUF blocks of {raw.shape[0]} rows for a {type(self).__name__} of parts "
                             f"{[s.full for s in self.slices]}; the GGUF file does not match the model")
        offsets = np.cumsum([0] + [s.full for s in self.slices])
        return np.concatenate([raw[o + s.start:o + s.start + s.size] for o, s in zip(offsets, self.slices)])


class RowParallelLinear(nn.Linear):
    """y = Σ_r x_r W_rᵀ + b: this rank's columns of W (its slice of the input), one all-reduce; the
    bias is whole on every rank and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup, what: str):
        self.in_slice = even_slice(in_features, tp, what)
        super().__init__(self.in_slice.size, out_features, bias=bias)
        self.tp = tp
        self.weight.weight_loader = self._narrow

    def _narrow(self, tensor: torch.Tensor, *, part: int | None, expert: int | None) -> torch.Tensor:
        return _narrow_rows(tensor, [self.in_slice], None, 1, type(self).__name__)

    def narrow_blocks(self, raw: np.ndarray, block_bytes: int) -> np.ndarray:
        """This rank's columns of a GGUF weight's quantized blocks [out, in / 32 * block_bytes]: whole
        32-wide blocks; ValueError unless this rank's slice of the input starts and ends on one."""
        start, size = self.in_slice.start, self.in_slice.size
        if start % 32 or size % 32:
            raise ValueError(f"{self.in_slice.full} inputs over {self.tp.size} ranks are {size} per rank, not "
                             "whole 32-wide GGUF blocks: serve it with --no-quantized-matmul or on fewer ranks")
        blocks = raw.reshape(raw.shape[0], self.in_slice.full // 32, block_bytes)
        return np.ascontiguousarray(blocks[:, start // 32:(start + size) // 32]).reshape(raw.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)


def _vocab_slice(vocab_size: int, tp: TensorParallelGroup) -> Slice:
    per_rank = -(-vocab_size // tp.size)
    return Slice(vocab_size, tp.rank * per_rank, per_rank)


def _narrow_vocab(tensor: torch.Tensor, rows: Slice, name: str) -> torch.Tensor:
    """This rank's vocabulary rows of an [V, H] tensor, zero-padded to rows.size past V."""
    if tensor.shape[0] != rows.full:
        raise ValueError(f"checkpoint tensor for {name} has {tensor.shape[0]} rows, the config's vocab_size is "
                         f"{rows.full}; does config.json match the checkpoint?")
    local = tensor[rows.start : rows.start + rows.size]
    out = tensor.new_zeros(rows.size, *tensor.shape[1:])
    out[: local.shape[0]] = local
    return out


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary; an id outside them looks up zeros; one all-reduce. The
    rows come out float32 (tensor parallelism runs in float32), whatever the table's dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup):
        self.rows = _vocab_slice(vocab_size, tp)
        super().__init__(self.rows.size, hidden_size, _weight=torch.empty(self.rows.size, hidden_size))  # uninitialised
        self.tp = tp
        self.weight.weight_loader = self._narrow

    def _narrow(self, tensor: torch.Tensor, *, part: int | None, expert: int | None) -> torch.Tensor:
        return _narrow_vocab(tensor, self.rows, type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).float()  # a 16-bit table's rows widened
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


def gather_vocab_logits(local: torch.Tensor, vocab_size: int, tp: TensorParallelGroup) -> torch.Tensor | None:
    """Each rank's logits [N, ceil(V/N)] of its vocabulary rows -> the full [N, V] on rank 0, None elsewhere."""
    parts = tp.gather_to_first(local.contiguous())
    return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]


class ParallelLMHead(nn.Module):
    """logits = hidden Wᵀ over this rank's vocabulary rows, gathered to rank 0 (float32), None on
    the other ranks: only rank 0 samples."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup):
        super().__init__()
        self.rows, self.vocab_size, self.tp = _vocab_slice(vocab_size, tp), vocab_size, tp
        self.weight = nn.Parameter(torch.empty(self.rows.size, hidden_size))
        self.weight.weight_loader = self._narrow

    def _narrow(self, tensor: torch.Tensor, *, part: int | None, expert: int | None) -> torch.Tensor:
        return _narrow_vocab(tensor, self.rows, type(self).__name__)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_vocab_logits(F.linear(hidden, self.weight).float(), self.vocab_size, self.tp)


# -- factories: the plain layer on one device, the parallel one on a group --------------------------


def column_linear(in_features: int, out_features: int, tp: TensorParallelGroup | None, *, bias: bool = False,
                  what: str = "out_features") -> nn.Linear:
    """[out, in], sharded by output rows."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, [even_slice(out_features, tp, what)], bias)


def merged_column_linear(in_features: int, part_sizes: Sequence[int], tp: TensorParallelGroup | None, *,
                         bias: bool = False, what: str = "intermediate_size") -> nn.Linear:
    """Parts concatenated along the output (gate | up), each sharded by rows."""
    if tp is None:
        return nn.Linear(in_features, sum(part_sizes), bias=bias)
    return ColumnParallelLinear(in_features, [even_slice(n, tp, what) for n in part_sizes], bias)


def qkv_linear(hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TensorParallelGroup | None,
               *, bias: bool = False) -> nn.Linear:
    """q | k | v, sharded by heads (KV heads replicated when N > num_kv_heads)."""
    if tp is None:
        return nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)
    q = head_slice(num_heads, head_dim, tp)
    kv = kv_head_slice(num_kv_heads, head_dim, tp)
    return ColumnParallelLinear(hidden_size, [q, kv, kv], bias)


def kv_linear(in_features: int, head_dim: int, num_kv_heads: int, tp: TensorParallelGroup | None, *,
              bias: bool = False) -> nn.Linear:
    """k or v alone [num_kv_heads * head_dim, in], sharded by KV heads (replicated when N > num_kv_heads)."""
    if tp is None:
        return nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
    return ColumnParallelLinear(in_features, [kv_head_slice(num_kv_heads, head_dim, tp)], bias)


def head_linear(in_features: int, num_heads: int, head_rows: int, tp: TensorParallelGroup | None, *,
                bias: bool = False, what: str = "num_attention_heads") -> nn.Linear:
    """[num_heads * head_rows, in], sharded by whole heads (`what` names num_heads in errors)."""
    if tp is None:
        return nn.Linear(in_features, num_heads * head_rows, bias=bias)
    return ColumnParallelLinear(in_features, [head_slice(num_heads, head_rows, tp, what)], bias)


def sliced_column_linear(in_features: int, full_parts: Sequence[int], slices: Sequence[Slice] | None, *,
                         bias: bool = False) -> nn.Linear:
    """A fused projection whose parts (full sizes `full_parts`, in order) are sharded as `slices` say
    (heads, groups, replicated groups); `slices` None: the plain layer of one device."""
    if slices is None:
        return nn.Linear(in_features, sum(full_parts), bias=bias)
    if [s.full for s in slices] != list(full_parts):
        raise ValueError(f"the slices {slices} do not cover the parts {list(full_parts)}")
    return ColumnParallelLinear(in_features, slices, bias)


def row_linear(in_features: int, out_features: int, tp: TensorParallelGroup | None, *, bias: bool = False,
               what: str = "in_features") -> nn.Linear:
    """[out, in], sharded by input columns, summed over the ranks."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp, what)


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TensorParallelGroup | None) -> nn.Embedding:
    if tp is None:  # an uninitialised weight: the checkpoint fills it (on the meta device, torch's random
        # init would import torch._dynamo, ~110 MiB and ~1 s of a load)
        return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)
