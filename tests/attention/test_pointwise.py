"""attention/pointwise.py: torch's activations up to float rounding, and an element's value never
depends on how many elements share the call (torch's own silu and softplus fail this on AVX-512)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockserve.attention.pointwise import silu, softplus


def test_same_values_as_torch_up_to_rounding():
    x = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 19.99, 20.0, 20.01])])
    torch.testing.assert_close(silu(x), F.silu(x), rtol=2e-6, atol=1e-30)
    torch.testing.assert_close(softplus(x), F.softplus(x), rtol=2e-6, atol=1e-30)
    assert silu(torch.tensor([float("nan")])).isnan().all() and softplus(torch.tensor([float("nan")])).isnan().all()


def test_an_elements_value_does_not_depend_on_the_call():
    """Every cut [t0, T) of 40 rows of 6 or 144 channels gives the rows the bits they get in [0, T)."""
    x = torch.randn(40, 150, generator=torch.Generator().manual_seed(0)) * 4
    for channels in (6, 144):
        rows = x[:, :channels].contiguous()
        for fn in (silu, softplus):
            for end in range(1, 41):
                whole = fn(rows[:end])
                assert all(torch.equal(whole[t0:], fn(rows[t0:end])) for t0 in range(end)), (fn.__name__, end)
