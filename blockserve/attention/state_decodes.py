"""The decode rows of a recurrent-state layer: one step per row, from the state in its slot.

Plain decodes are independent rows, stepped in one batch. A request whose step scores k drafts
(speculative decoding, `StateMetadata.chains`) owns k + 1 consecutive decode rows of one slot:
row i must start from the state after row i - 1. The rows then run in waves (wave j: every
row j of its chain, plain decodes in wave 0), each wave the same batched step a plain decode
runs, so every row's arithmetic is the one plain decoding does for that token: a verified
token's output and state are those of decoding it alone. Each row's state is kept (for the
rollback to the last accepted row, `worker/state_rollback.py`) and the last row's state is
left in the slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from blockserve.attention.context import StateMetadata

# step(rows, states before the rows) -> (output of the rows, states after them); `rows` indexes
# the step's decode rows (a slice or an int64 tensor), the states are per component [len(rows), *shape].
DecodeStep = Callable[[slice | torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, Sequence[torch.Tensor]]]


def run_decodes(layer_name: str, meta: StateMetadata, states: Sequence[torch.Tensor], out: torch.Tensor,
                step: DecodeStep) -> None:
    """Run the step's decode rows through `step`, reading and writing their slots in `states`
    (the layer's state tensors, [num_slots, *shape] each); outputs go to out[:num_decodes]."""
    nd = meta.layout.num_decodes
    slots = meta.slots[:nd]
    if not meta.chains:
        out[:nd], new = step(slice(0, nd), [t[slots] for t in states])
        for t, n in zip(states, new):
            t[slots] = n
        return
    if meta.decode_plan is None:  # the same for every state layer of the step
        meta.decode_plan = _waves(meta.chains, nd) + _captures(meta.row_captures)
    waves, last, capture_rows, capture_slots = meta.decode_plan
    after = [t.new_empty(nd, *t.shape[1:]) for t in states]
    for j, rows in enumerate(waves):
        before = [t[slots[rows]] for t in states] if j == 0 else [a[rows - 1] for a in after]
        out[rows], new = step(rows, before)
        for a, n in zip(after, new):
            a[rows] = n
    for t, a in zip(states, after):
        t[slots[last]] = a[last]
    if capture_rows is not None:
        for t, a in zip(states, after):
            t[capture_slots] = a[capture_rows]
    meta.row_states[layer_name] = after


def _captures(row_captures: list[tuple[int, int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(decode rows, checkpoint slots) of the captures after chain rows; (None, None) without any."""
    if not row_captures:
        return None, None
    return (torch.tensor([r for r, _ in row_captures], dtype=torch.int64),
            torch.tensor([s for _, s in row_captures], dtype=torch.int64))


def _waves(chains: list[tuple[int, int]], num_decodes: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(rows of each wave, the last row of each sequence): wave j holds row j of every chain and,
    in wave 0, the plain decodes."""
    offset = [0] * num_decodes
    is_last = [True] * num_decodes
    for first, length in chains:
        if first < 0 or length < 1 or first + length > num_decodes:
            raise ValueError(f"a chain of {length} rows from decode row {first} lies outside the "
                             f"{num_decodes} decode rows")
        for i in range(length):
            offset[first + i] = i
            is_last[first + i] = i == length - 1
    depth = max(offset) + 1
    waves = [[] for _ in range(depth)]
    for row, j in enumerate(offset):
        waves[j].append(row)
    last = [row for row in range(num_decodes) if is_last[row]]
    return [torch.tensor(w, dtype=torch.int64) for w in waves], torch.tensor(last, dtype=torch.int64)
