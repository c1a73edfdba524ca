"""What a forward pass needs besides the tokens: the KV cache and this step's metadata.

Passed explicitly through the model's forward (no global state). Each attention layer finds
its cache and its group's metadata by its layer name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockserve.attention.metadata import AttentionMetadata


@dataclass
class LayerCache:
    """One layer's slice of its group's KV tensor, and the group it belongs to."""

    group: int
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


@dataclass
class ForwardContext:
    layers: dict[str, LayerCache]
    metadata: list[AttentionMetadata]  # per KV cache group

    def for_layer(self, layer_name: str) -> tuple[LayerCache, AttentionMetadata]:
        cache = self.layers[layer_name]
        return cache, self.metadata[cache.group]
