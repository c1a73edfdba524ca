"""Where a model's tensors live and in which dtype: one frozen value, given to the model's constructor."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """The device and dtype of a model's weights, computed tables (RoPE, embedding scale) and KV /
    state specs. Model code reads them here and nowhere else; the default serves on the CPU in
    float32. (Parameters are declared on the meta device until `load_weights` places them.)"""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
