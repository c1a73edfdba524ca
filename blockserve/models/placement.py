"""Where a model's tensors live and in which dtype, and over which tensor-parallel group: one frozen
value, given to the model's constructor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from blockserve.tensor_parallel.group import TensorParallelGroup


@dataclass(frozen=True)
class Placement:
    """The device and dtype of a model's weights, computed tables (RoPE, embedding scale) and KV /
    state specs. Model code reads them here and nowhere else; the default serves on the CPU in
    float32. (Parameters are declared on the meta device until `load_weights` places them.)

    `tp`: the tensor-parallel group this rank's shard belongs to (tensor_parallel/group.py); None on
    one device, where every family builds its plain layers.

    `keep_16bit_weights`: the weights of linear layers and embeddings stored in bfloat16 or float16
    stay so, multiplied with float32 activations (models/half_linear.py), instead of being cast
    to `dtype`; the rest of the model is in `dtype`."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    tp: TensorParallelGroup | None = None
    keep_16bit_weights: bool = False
