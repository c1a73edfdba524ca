"""Linear layers and embeddings whose weights stay in the checkpoint's 16 bits (bfloat16 or
float16) while activations stay float32: the CPU serves a 16-bit checkpoint at its own size.

The loader keeps a 16-bit tensor in 16 bits where `placement.keep_16bit_weights` is set and
`keeps_16bit` says the parameter is one these modules can take over (models/weights.py); after
loading, `use_half_weights` puts them in place of the modules holding such weights:

    nn.Linear, column-parallel   ─► HalfLinear            y = x W^T + b
    row-parallel                 ─► HalfLinear(tp=...)    y = all_reduce(x_r W_r^T) + b
    nn.Embedding                 ─► HalfEmbedding         rows gathered in 16 bits, widened to float32
    vocab-parallel embedding        kept (it widens its rows itself)
    vocab-parallel LM head       ─► HalfParallelLMHead    this rank's logits, gathered to rank 0
    tied lm_head                 ─► model.tied_lm_head    a HalfLinear over the embedding's weight
                                                          (vocab-parallel: this rank's rows)

HalfLinear's matmul, per call, by the rows of x (each result the float32 matmul over the widened
weights up to float rounding; sums in float32):

    rows <= kernel_rows   csrc/half_matmul.cpp: weights widened in registers, read at 2 bytes each
    rows >  kernel_rows   the float32 GEMM over tiles of TILE_BYTES of the weight widened in turn
                          (also where the kernel is not built); no float32 copy is kept

KERNEL_ROWS holds the crossover per build (AVX-512: 16 lanes, AVX2: 8), measured with
`python -m benchmarks.half_weights --kernels` (docs/cpu.md). A module of another kind (MoE experts,
a weight read as a matrix elsewhere) keeps float32: the
loader widens its weight, and the engine's start-up report says what each dtype holds
(models/weight_memory.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.native.extension import half_matmul_ops
from blockserve.native.gate import native_reads
from blockserve.tensor_parallel.group import TensorParallelGroup
from blockserve.tensor_parallel.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                               VocabParallelEmbedding, gather_vocab_logits)

HALF_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_ROWS = {16: 64, 8: 32}  # the kernel's lanes -> the most rows it serves before the tiled GEMM
TILE_BYTES = 2 << 20  # float32 bytes of one widened tile of the weight (in L2 on the CPUs measured)
_TAKEN_OVER = (nn.Linear, ColumnParallelLinear, RowParallelLinear, nn.Embedding, VocabParallelEmbedding,
               ParallelLMHead)


def keeps_16bit(module: nn.Module, leaf: str) -> bool:
    """Whether `module`'s parameter `leaf` may stay in a 16-bit checkpoint dtype: the weight of a
    plain, column- or row-parallel linear layer, an embedding (vocab-parallel too) or a
    vocab-parallel LM head, unless the module reads its weight as a matrix elsewhere
    (`keep_row_major`, models/weight_layout.py)."""
    return leaf == "weight" and type(module) in _TAKEN_OVER and not getattr(module, "keep_row_major", False)


def converted_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ weight^T (weight [N, K], 16-bit) as float32 GEMMs over row tiles of the
    weight widened one at a time (at most TILE_BYTES each)."""
    rows, width = weight.shape
    tile = max(16, TILE_BYTES // (4 * max(1, width)))
    out = x.new_empty(x.shape[0], rows)
    for start in range(0, rows, tile):
        torch.mm(x, weight[start : start + tile].float().t(), out=out[:, start : start + tile])
    return out


class HalfLinear(nn.Module):
    """y = x W^T + b with W [out, in] in 16 bits and x, b, y float32 (see the module docstring).
    `tp`: a row-parallel layer's group (W holds this rank's columns; the partial products are
    all-reduced before the bias); None otherwise."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, tp: TensorParallelGroup | None = None):
        super().__init__()
        if weight.dim() != 2 or weight.dtype not in HALF_DTYPES:
            raise ValueError(f"HalfLinear takes a 2-D bfloat16 or float16 weight, not {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.tp = tp
        ops = half_matmul_ops()
        lanes = 0 if ops is None else ops.half_matmul_lanes()
        self.kernel = ops.half_matmul if lanes else None
        self.kernel_rows = KERNEL_ROWS.get(lanes, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None and rows.shape[0] <= self.kernel_rows and native_reads(rows):
            out = self.kernel(rows, self.weight)
        else:
            out = converted_matmul(rows.float(), self.weight)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class HalfParallelLMHead(nn.Module):
    """A vocab-parallel LM head over this rank's 16-bit rows: float32 logits gathered to rank 0
    (None on the others), as ParallelLMHead."""

    def __init__(self, head: ParallelLMHead):
        super().__init__()
        self.linear = HalfLinear(head.weight)
        self.vocab_size, self.tp = head.vocab_size, head.tp

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_vocab_logits(self.linear(hidden), self.vocab_size, self.tp)


class HalfEmbedding(nn.Module):
    """An embedding table kept in 16 bits: looked-up rows are widened to float32."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dim() != 2 or weight.dtype not in HALF_DTYPES:
            raise ValueError(f"HalfEmbedding takes a 2-D bfloat16 or float16 table, not {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight).float()


def use_half_weights(model: nn.Module) -> int:
    """Put HalfLinear / HalfEmbedding in place of every module `keeps_16bit` covers whose weight
    was loaded in 16 bits, and give a tied model its `tied_lm_head` over the 16-bit embedding.
    Returns how many modules now hold 16-bit weights."""
    replaced = 0
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not (isinstance(weight, torch.Tensor) and weight.dtype in HALF_DTYPES and keeps_16bit(module, "weight")):
            continue
        if isinstance(module, VocabParallelEmbedding):
            replaced += 1  # widens its rows itself
            continue
        if isinstance(module, ParallelLMHead):
            half: nn.Module = HalfParallelLMHead(module)
        elif isinstance(module, nn.Embedding):
            half = HalfEmbedding(weight)
        else:
            half = HalfLinear(weight, module.bias, module.tp if isinstance(module, RowParallelLinear) else None)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, half)
        replaced += 1
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (getattr(model, "tie_word_embeddings", False) and isinstance(embedding, (HalfEmbedding, VocabParallelEmbedding))
            and embedding.weight.dtype in HALF_DTYPES):
        model.tied_lm_head = HalfLinear(embedding.weight)  # vocab-parallel: this rank's rows, gathered by the model
    return replaced

