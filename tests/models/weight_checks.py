"""Two checks every family's loader gets: a checkpoint on disk and transformers' state_dict load the
same parameters, and wrong weights are named in the error."""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models.loader import load_model
from blockserve.models.registry import model_class


def assert_checkpoint_loads_like_state_dict(path, reference) -> None:
    """The model loaded from `path` (its checkpoint's names) has the parameters of one built from
    `reference.state_dict()` (transformers' names), bit for bit."""
    from_checkpoint = load_model(str(path), BACKENDS["exact"]).model
    from_state_dict = model_class(reference.config.architectures)(reference.config, BACKENDS["exact"])
    from_state_dict.load_weights(reference.state_dict().items())
    a, b = dict(from_checkpoint.named_parameters()), dict(from_state_dict.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_wrong_weights_are_named(reference) -> None:
    """A missing weight and an unexpected one are both named by load_weights."""
    weights = dict(reference.state_dict())
    del weights[next(name for name in weights if "layers.1." in name)]
    weights["model.layers.0.bogus.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected weights.*bogus.*missing weights.*layers.1"):
        model_class(reference.config.architectures)(reference.config, BACKENDS["exact"]).load_weights(weights.items())
