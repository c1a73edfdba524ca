"""What a forward pass needs besides the tokens: the KV cache and this step's metadata.

Passed explicitly through the model's forward (no global state). Each layer that owns KV finds
its cache and its group's metadata by its layer name:

    attention layer   LayerCache   k_cache, v_cache [num_blocks, block_size, kv_heads, head_size]
    MLA layer         MLACache     cache [num_blocks, block_size, kv_lora_rank + rope_dim]
    recurrent layer   StateCache   tensors[i] [num_slots, *shape_i] (e.g. conv state, SSM state)

Attention and MLA groups get `AttentionMetadata`; state groups get `StateMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockserve.attention.metadata import AttentionMetadata, BatchLayout


@dataclass
class LayerCache:
    """One attention layer's slice of its group's KV tensor, and the group it belongs to."""

    group: int
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


@dataclass
class MLACache:
    """One MLA layer's latent cache: the compressed KV and the rope key of every token."""

    group: int
    cache: torch.Tensor  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]


@dataclass
class StateCache:
    """One recurrent layer's state tensors, one slot per running request (slot 0: null)."""

    group: int
    tensors: list[torch.Tensor]  # per state component: [num_slots, *shape]


@dataclass
class StateMetadata:
    """Per step, for a state group: each sequence's slot, in batch order.

    A sequence with `layout.seq_lens[i] - query_len == 0` starts from its slot's state, which is
    zero because new slots are zeroed (C1: the state spec demands it); a restored or continuing
    sequence reads the state its slot holds.

    `captures[i]`: (position, checkpoint slot) pairs for sequence i, positions strictly inside
    its segment and on the kernel's chunk grid: the layer writes its state after the first
    `position` tokens into that slot. (A capture at a segment's end is a copy of the final
    state, done by the model runner after the forward.)

    State tensors are float32 whatever the model's dtype (the layers compute the recurrence in
    float32 and return the model's dtype).

    Speculative decoding: `chains` lists (first decode row, rows) of each request whose step
    scores drafts; its rows are decodes of one slot that the layers run one after another (row i
    starts from row i - 1's state, by the decode step's arithmetic), leave the last row's state
    in the slot and keep every row's state in `row_states[layer name]` (per state component,
    [num_decodes, *shape]) for the rollback to the last accepted row. `row_captures`: (decode
    row, checkpoint slot) pairs whose state after that row goes into the checkpoint slot.
    """

    layout: BatchLayout
    slots: torch.Tensor  # [B] int64, on the model's device
    captures: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    slot_ids: list[int] | None = None  # `slots` on the host: what control flow reads (None: read from slots)
    chains: list[tuple[int, int]] = field(default_factory=list)
    row_captures: list[tuple[int, int]] = field(default_factory=list)
    row_states: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # written by the layers
    decode_plan: tuple | None = None  # the chains' waves, built by the first layer that runs them

    def __post_init__(self) -> None:
        if self.slot_ids is None:  # built on the host (the worker passes the list it has)
            self.slot_ids = self.slots.tolist()


@dataclass
class ForwardContext:
    layers: dict[str, LayerCache | MLACache | StateCache]
    metadata: list[AttentionMetadata | StateMetadata]  # per KV cache group
    # What the model settles once over these caches and reuses every step (e.g. models/llama_decode.py's
    # plan). The model runner passes one dict for as long as its caches live; a fresh one is correct, only slower.
    memo: dict = field(default_factory=dict)
    # [T, hidden] states the model takes with the step's tokens, in batch order: a multi-token-prediction
    # head's target hidden states (models/mtp.py); None for every other model.
    hidden_inputs: torch.Tensor | None = None

    def for_layer(self, layer_name: str):
        """(the layer's cache, its group's metadata for this step)."""
        cache = self.layers[layer_name]
        return cache, self.metadata[cache.group]
