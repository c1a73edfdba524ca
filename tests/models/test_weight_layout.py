"""Column-major linear weights: same values, transposes contiguous, opt-outs respected."""

from __future__ import annotations

import torch
from torch import nn

from blockserve.models.weight_layout import use_input_major_linears


class _Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.tie_word_embeddings = tied
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(11, 4)
        self.proj = nn.Linear(4, 6)
        self.kept = nn.Linear(4, 6, bias=False)
        self.kept.keep_row_major = True


def test_linears_and_a_tied_embedding_become_column_major_with_the_same_values():
    model = _Tiny(tied=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    use_input_major_linears(model)
    assert model.proj.weight.t().is_contiguous() and model.model.embed_tokens.weight.t().is_contiguous()
    assert model.kept.weight.is_contiguous()  # opted out: other code views it per head
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
    x = torch.randn(3, 4)
    torch.testing.assert_close(model.proj(x), x @ before["proj.weight"].t() + before["proj.bias"])


def test_an_untied_embedding_stays_row_major():
    model = _Tiny(tied=False)
    use_input_major_linears(model)
    assert model.model.embed_tokens.weight.is_contiguous()
    assert model.proj.weight.t().is_contiguous()
