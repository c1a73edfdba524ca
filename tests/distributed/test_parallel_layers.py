"""Each parallel layer equals its dense version, on 2 gloo ranks (one process and thread each).

Within 1e-5, relative and absolute: a GEMM over fewer output rows
may block its sums differently, and the all-reduce adds the ranks' partial sums in another order
than one GEMM does. Embedding lookups and the gathered logits are exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockserve.models.layers import GatedMLP
from blockserve.tensor_parallel.layers import (
    ParallelLMHead,
    VocabParallelEmbedding,
    gather_vocab_logits,
    qkv_linear,
    row_linear,
)
from tests.distributed.ranks import run_ranks

pytestmark = pytest.mark.slow  # two spawned gloo ranks

HIDDEN, HEAD_DIM, HEADS = 32, 8, 4


def _load(module: nn.Module, named: dict[str, torch.Tensor]) -> None:
    """What models/weights.py does: each full tensor through the parameter's weight_loader, per part."""
    for name, param in list(module.named_parameters()):
        pieces = named[name]
        if isinstance(pieces, list):  # the parts of a fused weight, one call each
            tensor = torch.cat([param.weight_loader(t, part=i, expert=None) for i, t in enumerate(pieces)])
        else:
            loader = getattr(param, "weight_loader", None)
            tensor = pieces if loader is None else loader(pieces, part=None, expert=None)
        assert tensor.shape == param.shape, (name, tensor.shape, param.shape)
        module_path, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(module_path), leaf, nn.Parameter(tensor, requires_grad=False))


def _check_layers(tp):
    torch.manual_seed(0)  # the same full weights and inputs on every rank
    x = torch.randn(5, HIDDEN)
    for kv_heads in (1, 2, 4):  # 1: replicated across the two ranks
        q, k, v = (torch.randn(n * HEAD_DIM, HIDDEN) for n in (HEADS, kv_heads, kv_heads))
        bias = [torch.randn(n * HEAD_DIM) for n in (HEADS, kv_heads, kv_heads)]
        for fused_in_checkpoint in (False, True):
            layer = qkv_linear(HIDDEN, HEAD_DIM, HEADS, kv_heads, tp, bias=True)
            _load(layer, {"weight": torch.cat([q, k, v]) if fused_in_checkpoint else [q, k, v],
                          "bias": torch.cat(bias) if fused_in_checkpoint else bias})
            local_q, kv = HEADS // tp.size, max(1, kv_heads // tp.size)
            kv_head = tp.rank * kv if kv_heads >= tp.size else tp.rank // (tp.size // kv_heads)
            out = layer(x).split([local_q * HEAD_DIM, kv * HEAD_DIM, kv * HEAD_DIM], dim=-1)
            rows = slice(tp.rank * local_q * HEAD_DIM, (tp.rank + 1) * local_q * HEAD_DIM)
            kv_rows = slice(kv_head * HEAD_DIM, (kv_head + kv) * HEAD_DIM)
            for got, w, b, r in zip(out, (q, k, v), bias, (rows, kv_rows, kv_rows)):
                torch.testing.assert_close(got, F.linear(x, w[r], b[r]), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"kv_heads={kv_heads} fused={fused_in_checkpoint}: {m}")

    w, b = torch.randn(HIDDEN, 48), torch.randn(HIDDEN)
    row = row_linear(48, HIDDEN, tp, bias=True)
    _load(row, {"weight": w, "bias": b})
    x_local = torch.randn(5, 48)
    torch.testing.assert_close(row(x_local.chunk(tp.size, dim=1)[tp.rank].contiguous()), F.linear(x_local, w, b),
                               rtol=1e-5, atol=1e-5)

    dense, parallel = GatedMLP(HIDDEN, 24), GatedMLP(HIDDEN, 24, tp=tp)
    gate, up, down = torch.randn(24, HIDDEN), torch.randn(24, HIDDEN), torch.randn(HIDDEN, 24)
    _load(dense, {"gate_up_proj.weight": torch.cat([gate, up]), "down_proj.weight": down})
    _load(parallel, {"gate_up_proj.weight": [gate, up], "down_proj.weight": down})
    torch.testing.assert_close(parallel(x), dense(x), rtol=1e-5, atol=1e-5)

    vocab = 13  # not divisible by 2: the last rank's rows are padded
    table = torch.randn(vocab, HIDDEN)
    embedding = VocabParallelEmbedding(vocab, HIDDEN, tp)
    _load(embedding, {"weight": table})
    ids = torch.tensor([0, 6, 7, 12, 3, 12])
    assert torch.equal(embedding(ids), F.embedding(ids, table))

    head = ParallelLMHead(HIDDEN, vocab, tp)
    _load(head, {"weight": table})
    logits, tied = head(x), gather_vocab_logits(F.linear(x, embedding.weight).float(), vocab, tp)
    if tp.rank == 0:
        torch.testing.assert_close(logits, F.linear(x, table), rtol=1e-5, atol=1e-5)
        assert torch.equal(tied, logits)
    else:
        assert logits is None and tied is None
    return "ok"


def test_parallel_layers_equal_dense_on_two_ranks():
    assert run_ranks(_check_layers, 2) == ["ok", "ok"]
