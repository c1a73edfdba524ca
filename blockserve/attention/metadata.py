"""Per-step attention metadata of one KV cache group, built once and shared by its layers.

The batch is flattened: sequence i owns query tokens [query_start[i], query_start[i+1]).
Decodes (one query token) come first, so they can be attended in one batched call; prefill
chunks follow and are attended one sequence at a time.

    tokens      [d0][d1][d2][p0 p0 p0 p0][p1 p1]        num_decodes = 3
    slot of token t = block_table[seq(t), pos(t) // block_size] * block_size + pos(t) % block_size

Block 0 of every pool is the null block: never written, always zero, so a table padded with
it (or a gather padded with its slots) reads zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BatchLayout:
    """How the step's tokens are laid out; shared by every group."""

    query_start: list[int]  # len B + 1
    seq_lens: list[int]  # context length after this step, per sequence
    num_decodes: int
    positions: torch.Tensor  # [T] int64
    seq_of_token: torch.Tensor  # [T] int64

    @staticmethod
    def build(query_lens: list[int], num_computed: list[int]) -> BatchLayout:
        """`num_computed[i]`: tokens of sequence i whose KV was written before this step.
        Decodes (query length 1) must come first."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        lens = torch.tensor(query_lens, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), lens)
        offset = torch.tensor(num_computed, dtype=torch.int64) - torch.tensor(query_start[:-1], dtype=torch.int64)
        positions = torch.arange(query_start[-1], dtype=torch.int64) + offset[seq_of_token]
        seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
        return BatchLayout(query_start, seq_lens, num_decodes, positions, seq_of_token)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass
class AttentionMetadata:
    layout: BatchLayout
    block_size: int
    block_table: torch.Tensor  # [B, W] int64 in batch order, padded with the null block
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    key_start: torch.Tensor  # [B] int64: the first position any query of the sequence sees
    sliding_window: int | None = None
    # What a backend derives from this metadata (gather indices, masks), computed by the first
    # layer of the step and reused by the others. Dies with the step.
    derived: dict = field(default_factory=dict)

    @staticmethod
    def build(layout: BatchLayout, block_table: torch.Tensor, block_size: int,
              sliding_window: int | None = None) -> AttentionMetadata:
        blocks = block_table[layout.seq_of_token, layout.positions // block_size]
        slot_mapping = blocks * block_size + layout.positions % block_size
        if sliding_window is None:
            key_start = torch.zeros(layout.num_seqs, dtype=torch.int64)
        else:  # the first query of a sequence, at position seq_len - q, sees back window - 1 tokens
            first_query = torch.tensor(layout.seq_lens) - torch.diff(torch.tensor(layout.query_start))
            key_start = (first_query - sliding_window + 1).clamp(min=0)
        return AttentionMetadata(layout, block_size, block_table, slot_mapping, key_start, sliding_window)
