"""The decode rows of a recurrent-state layer: one step per row, from the state in its slot.

A state layer's decode step has three parts (`StateDecode`): a depthwise causal conv over the
row's window (its slot's conv state, then the row's input), per-row features of the conv output
(activations, norms, gathered per-token inputs), and the recurrence of those features on the
recurrent state. Plain decodes are independent rows, stepped in one batch.

A request whose step scores k drafts (speculative decoding, `StateMetadata.chains`) owns k + 1
consecutive decode rows of one slot: row i must start from the state after row i - 1. Only the
recurrence has to wait for row i - 1: row i's conv window is the slot's conv state followed by
the chain's inputs up to row i, all known before the step. So a step with chains gathers every
row's window at once and computes the conv and the features of all its decode rows in one
batch; the recurrence then runs in waves (wave j: row j of every sequence, a plain decode being
a sequence of one row), the rows laid out wave after wave with the sequences longest first, so
that each wave is a contiguous slice and starts from the leading rows of the states the wave
before it produced. Every row's arithmetic is the plain step's for that token, elementwise or
per row (the activations give the same bits wherever an element falls, `pointwise.py`), so a
verified token's output and state are those of decoding it alone. Each row's states are kept
(for the rollback to the last accepted row, `worker/state_rollback.py`) and the last row's
states are left in the slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from blockserve.attention.context import StateMetadata


@dataclass(frozen=True)
class StateDecode:
    """One state layer's decode step, split where a chain's row waits for the row before it.

    conv_input [T, C]: the step's conv inputs (decode rows first); conv_weight [C, K]; conv_bias [C] or None.
    features(conv outputs [n, C] before the activation, the rows they belong to: a slice or an
        int64 tensor of step rows) -> the recurrence's per-row inputs, each [n, ...].
    recur(*per-row inputs, recurrent states [n, *shape]) -> (outputs [n, ...], new states).
    rows: None, or the same recurrence over all rows in one call (a native kernel):
        rows(*per-row inputs, state table [num_slots, *shape], source int64 [n], out [n, ...],
        after [n, *shape]) writes row p's output to out[p] and its state to after[p], starting
        from after[source[p]] (an earlier row) or table[-source[p] - 1] (a slot). When given, plain
        decodes and chains both run it, so both keep one arithmetic.
    """

    conv_input: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    features: Callable[[torch.Tensor, slice | torch.Tensor], tuple[torch.Tensor, ...]]
    recur: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rows: Callable[..., None] | None = None


def conv_output(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The conv at one position: window [B, C, K] (the K inputs up to it), weight [C, K] -> [B, C]."""
    y = (window * weight).sum(-1)
    return y if bias is None else y + bias


def causal_conv1d_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """One token per sequence: x [B, C], state [B, C, K - 1] -> (y [B, C], new state)."""
    window = torch.cat([state, x[..., None]], dim=-1)  # [B, C, K]
    return conv_output(window, weight, bias), window[..., 1:]


class ChainPlan(NamedTuple):
    """The decode rows of a step with chains, laid out wave after wave (the same for every state layer)."""

    order: torch.Tensor | None  # [num_decodes] the decode row at each position of the layout; None: the rows' own order
    inverse: torch.Tensor | None  # [num_decodes] each decode row's position in the layout
    waves: list[tuple[int, int, int]]  # (start, end, rows of the next wave) per wave
    first_rows: torch.Tensor  # each sequence's first decode row, longest sequences first
    source: torch.Tensor  # per position: the position of its sequence's previous row, or -1 - its slot
    chain_pos: list[int]  # each layout position's row index within its sequence
    sequence: list[int]  # each layout position's sequence (its index in first_rows)
    last: torch.Tensor  # the last decode row of each sequence
    capture_rows: torch.Tensor | None  # decode rows whose states go to checkpoint slots
    capture_slots: torch.Tensor | None
    conv_index: dict[int, torch.Tensor]  # per conv width: each position's window in the gather source


def run_decodes(layer_name: str, meta: StateMetadata, states: Sequence[torch.Tensor], out: torch.Tensor,
                decode: StateDecode) -> None:
    """Run the step's decode rows, reading and writing their slots in `states` (the layer's conv
    and recurrent states, [num_slots, *shape] each); outputs go to out[:num_decodes]."""
    nd = meta.layout.num_decodes
    slots = meta.slots[:nd]
    conv_states, rec_states = states
    if not meta.chains:
        mixed, conv_states[slots] = causal_conv1d_step(decode.conv_input[:nd], conv_states[slots],
                                                       decode.conv_weight, decode.conv_bias)
        features = decode.features(mixed, slice(0, nd))
        if decode.rows is None:
            out[:nd], rec_states[slots] = decode.recur(*features, rec_states[slots])
        else:
            after = rec_states.new_empty(nd, *rec_states.shape[1:])
            decode.rows(*(f.contiguous() for f in features), rec_states, -1 - slots, out[:nd], after)
            rec_states[slots] = after
        return
    if meta.decode_plan is None:
        meta.decode_plan = _plan(meta.chains, meta.row_captures, slots)
    plan: ChainPlan = meta.decode_plan
    windows = _windows(plan, conv_states, slots, decode.conv_input[:nd], decode.conv_weight.shape[1])
    rows = slice(0, nd) if plan.order is None else plan.order
    features = decode.features(conv_output(windows, decode.conv_weight, decode.conv_bias), rows)
    rec_after = rec_states.new_empty(nd, *rec_states.shape[1:])
    y = out[:nd] if plan.order is None else out.new_empty(nd, *out.shape[1:])
    if decode.rows is None:
        state = rec_states[slots[plan.first_rows]]
        for start, end, following in plan.waves:
            y[start:end], rec_after[start:end] = decode.recur(*(f[start:end] for f in features), state)
            state = rec_after[start:start + following]
    else:
        decode.rows(*(f.contiguous() for f in features), rec_states, plan.source, y, rec_after)
    after = [windows[:, :, 1:], rec_after]  # per decode row
    if plan.order is not None:
        out[plan.order] = y
        after = [a[plan.inverse] for a in after]
    for t, a in zip(states, after):
        t[slots[plan.last]] = a[plan.last]
    if plan.capture_rows is not None:
        for t, a in zip(states, after):
            t[plan.capture_slots] = a[plan.capture_rows]
    meta.row_states[layer_name] = after


def _windows(plan: ChainPlan, conv_states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
             width: int) -> torch.Tensor:
    """Each decode row's conv window [num_decodes, C, width] in the plan's layout: the last
    width - 1 inputs before the row (its sequence's earlier rows, then the slot's conv state)
    and the row's input, as the plain step concatenates them."""
    index = plan.conv_index.get(width)
    if index is None:
        index = plan.conv_index[width] = _conv_index(plan, x.shape[0], width)
    history = conv_states[slots[plan.first_rows]].transpose(1, 2).reshape(-1, x.shape[1])  # [seqs * (K-1), C]
    return torch.cat([x, history])[index].transpose(1, 2).contiguous()


def _conv_index(plan: ChainPlan, num_decodes: int, width: int) -> torch.Tensor:
    """[num_decodes, width]: where each window's inputs lie in cat([decode inputs, the sequences'
    conv states, width - 1 rows each])."""
    firsts, index = plan.first_rows.tolist(), []
    for pos, seq in zip(plan.chain_pos, plan.sequence):
        back = [pos - width + 1 + c for c in range(width)]  # the inputs' positions within the sequence
        index.append([firsts[seq] + p if p >= 0 else num_decodes + seq * (width - 1) + width - 1 + p
                      for p in back])
    return torch.tensor(index, dtype=torch.int64)


def _plan(chains: list[tuple[int, int]], row_captures: list[tuple[int, int]], slots: torch.Tensor) -> ChainPlan:
    """The wave layout of the decode rows (in `slots`) of which `chains` (first row, rows) are chains."""
    num_decodes = slots.shape[0]
    length = [1] * num_decodes  # per sequence's first row; 0 for a chain's later rows
    for first, rows in chains:
        if first < 0 or rows < 1 or first + rows > num_decodes:
            raise ValueError(f"a chain of {rows} rows from decode row {first} lies outside the "
                             f"{num_decodes} decode rows")
        length[first] = rows
        for row in range(first + 1, first + rows):
            length[row] = 0
    firsts = sorted((row for row in range(num_decodes) if length[row]), key=lambda row: -length[row])
    order, chain_pos, sequence, waves, previous = [], [], [], [], []
    for j in range(length[firsts[0]]):
        start = len(order)
        for seq, first in enumerate(firsts):
            if length[first] <= j:
                break
            previous.append(waves[-1][0] + seq if j else -1)
            order.append(first + j)
            chain_pos.append(j)
            sequence.append(seq)
        waves.append((start, len(order), sum(length[first] > j + 1 for first in firsts)))
    order_t = torch.tensor(order, dtype=torch.int64)
    source = torch.tensor(previous, dtype=torch.int64, device=slots.device)
    source = torch.where(source >= 0, source, -1 - slots[order_t])
    inverse = torch.empty_like(order_t)
    inverse[order_t] = torch.arange(num_decodes)
    if order == list(range(num_decodes)):
        order_t = inverse = None
    last = torch.tensor(sorted(first + length[first] - 1 for first in firsts), dtype=torch.int64)
    capture_rows = capture_slots = None
    if row_captures:
        capture_rows = torch.tensor([r for r, _ in row_captures], dtype=torch.int64)
        capture_slots = torch.tensor([s for _, s in row_captures], dtype=torch.int64)
    return ChainPlan(order_t, inverse, waves, torch.tensor(firsts, dtype=torch.int64), source, chain_pos, sequence,
                     last, capture_rows, capture_slots, {})
