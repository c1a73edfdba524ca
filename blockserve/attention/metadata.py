"""Per-step attention metadata of one KV cache group, built once and shared by its layers.

The batch is flattened: sequence i owns query tokens [query_start[i], query_start[i+1]).
Decodes (one query token) come first, so they can be attended in one batched call; prefill
chunks follow and are attended one sequence at a time.

    tokens      [d0][d1][d2][p0 p0 p0 p0][p1 p1]        num_decodes = 3
    slot of token t = block_table[seq(t), pos(t) // block_size] * block_size + pos(t) % block_size

Block 0 of every pool is the null block: never written, always zero, so a table padded with
it (or a gather padded with its slots) reads zeros.

Host and device: the metadata is built on the host from Python lists, then its tensors move to
the model's device in one copy per step (`to_device`; nothing moves on the CPU). Each device
metadata keeps its host twin (`host`): what a backend derives (gather indices, masks) is
computed from the twin and the lists, then moved once per step. Control flow in the forward
reads the lists (`layout.seq_lens`, `key_starts`, ...), never a device tensor.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree


def to_device(tree, device: torch.device):
    """`tree` (tensors in tuples, lists, dicts, named tuples) with every tensor on `device`: on
    CUDA from pinned host memory, non-blocking (the pinned staging buffers come from torch's caching
    host allocator, which keeps a buffer until its copy is done); int64 tensors go in one packed
    copy. On the CPU `tree` itself."""
    if device.type == "cpu":
        return tree
    leaves, spec = pytree.tree_flatten(tree)
    packed = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dtype == torch.int64]
    moved = list(leaves)
    if packed:
        sizes = [leaves[i].numel() for i in packed]
        flat = torch.cat([leaves[i].reshape(-1) for i in packed]).pin_memory().to(device, non_blocking=True)
        for i, part in zip(packed, flat.split(sizes)):
            moved[i] = part.view(leaves[i].shape)
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and i not in packed:
            moved[i] = t.pin_memory().to(device, non_blocking=True)
    return pytree.tree_unflatten(moved, spec)


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A host int64 tensor of `values` (Python ints), made through an array: for the per-step index
    lists, several times faster than torch.tensor on a list (~5 us against ~19 us for 256 values)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


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
        if num_decodes == len(query_lens):  # decode-only: each sequence's next position (the same, in 2 ops not 8)
            return BatchLayout(list(range(num_decodes + 1)), [c + 1 for c in num_computed], num_decodes,
                               int64_tensor(num_computed), torch.arange(num_decodes))
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), int64_tensor(query_lens))
        offset = int64_tensor(num_computed) - int64_tensor(query_start[:-1])
        positions = torch.arange(query_start[-1], dtype=torch.int64) + offset[seq_of_token]
        seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
        return BatchLayout(query_start, seq_lens, num_decodes, positions, seq_of_token)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.positions, self.seq_of_token

    def with_tensors(self, positions: torch.Tensor, seq_of_token: torch.Tensor) -> BatchLayout:
        return dataclasses.replace(self, positions=positions, seq_of_token=seq_of_token)


@dataclass
class AttentionMetadata:
    layout: BatchLayout
    block_size: int
    # [B, W] int64 in batch order. Row i's columns below cdiv(seq_len_i, block_size) are its blocks (the
    # null block where a window released one); the columns past them are never read and may hold stale
    # ids (a reused row, an earlier wider step). W covers every row's blocks; it is the step's longest
    # context rounded up (input_batch.py), so it may be less than table_capacity.
    block_table: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    key_start: torch.Tensor  # [B] int64: the first position any query of the sequence sees
    seq_len: torch.Tensor  # [B] int64: layout.seq_lens as a tensor (for backends that read no host list)
    sliding_window: int | None = None
    table_capacity: int | None = None  # columns any sequence's table can have (max_model_len's); None: W
    # What a backend derives from this metadata (gather indices, masks), computed by the first
    # layer of the step and reused by the others. Dies with the step.
    derived: dict = field(default_factory=dict)
    key_starts: list[int] = field(default_factory=list)  # key_start on the host
    host: AttentionMetadata | None = None  # the host twin of device metadata (None: this is on the host)
    # A captured step's (worker/cuda_graphs.py): no shape may depend on a tensor's values.
    static_shapes: bool = False

    @property
    def max_table_width(self) -> int:
        """The columns a sequence's table can have, whatever this step's width (a shape fact)."""
        return self.table_capacity or self.block_table.shape[1]

    @property
    def on_host(self) -> AttentionMetadata:
        """This metadata as built on the host (itself on the CPU)."""
        return self if self.host is None else self.host

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.layout.tensors(), self.block_table, self.slot_mapping, self.key_start, self.seq_len)

    def with_tensors(self, positions, seq_of_token, block_table, slot_mapping, key_start, seq_len) -> AttentionMetadata:
        """The device twin: these tensors (moved), the same lists, this metadata as its host."""
        return dataclasses.replace(self, layout=self.layout.with_tensors(positions, seq_of_token),
                                   block_table=block_table, slot_mapping=slot_mapping, key_start=key_start,
                                   seq_len=seq_len, derived={}, host=self)

    def derive(self, key, compute):
        """compute(host metadata) -> tensors, once per step and key, moved to this metadata's device."""
        if key not in self.derived:
            self.derived[key] = to_device(compute(self.on_host), self.slot_mapping.device)
        return self.derived[key]

    @staticmethod
    def build(layout: BatchLayout, block_table: torch.Tensor, block_size: int,
              sliding_window: int | None = None, table_capacity: int | None = None) -> AttentionMetadata:
        blocks = block_table[layout.seq_of_token, layout.positions // block_size]
        slot_mapping = blocks * block_size + layout.positions % block_size
        if sliding_window is None:
            key_starts = [0] * layout.num_seqs
        else:  # the first query of a sequence, at position seq_len - q, sees back window - 1 tokens
            key_starts = [max(0, seq_len - (end - start) - sliding_window + 1) for seq_len, start, end
                          in zip(layout.seq_lens, layout.query_start, layout.query_start[1:])]
        key_start = int64_tensor(key_starts)
        seq_len = int64_tensor(layout.seq_lens)
        return AttentionMetadata(layout, block_size, block_table, slot_mapping, key_start, seq_len, sliding_window,
                                 table_capacity, key_starts=key_starts)
