"""CUDA graphs for decode steps: the model's forward over B decode rows, captured once per batch
size B in `sizes` and replayed with each step's inputs copied into the tensors it was captured on.

    step of n decode rows ─► bucket B: the smallest size >= n
                          ─► rows [0, n): the step's inputs; rows [n, B): padding
                          ─► copies host -> device into B's static inputs ─► replay ─► hidden[:n]

The static inputs are one flat int64 tensor of the per-row fields (copied whole) and, per attention
group, a block table as wide as max_model_len allows, one for all sizes (size B's is its first B
rows: the graphs run one at a time). A step's table is narrower (its longest context's,
input_batch.py), and only its columns are copied: the columns past them keep an earlier step's ids,
past every row's sequence length, which no backend reads (AttentionMetadata.block_table).

A captured forward is frozen: on replay every kernel it launched runs again on the same tensors,
while whatever Python read during the capture (a host list, a shape, a dict) keeps the value it
had then. So a layer may be captured only if its decode reads nothing but tensors:
`graph_blockers` asks every module that could not (`cuda_graph_blocker()`), and the static
metadata's host lists hold placeholders that no captured layer reads.

Padding rows are token 0 at position 0 of a one-token sequence whose only block is its group's
scratch block (state groups: the scratch slot; worker/kv_tensors.py): they write and read only
memory no request owns, and never the null block, which stays zero (C1).

`capture(forward) -> (replay, output)` is `cuda_capture` on a GPU; tests pass one that replays
eagerly with the same frozen metadata, which catches a layer that reads host values (CI has no GPU).
A capture keeps no reference to `forward`: the caller keeps it (and so every tensor the captured
kernels read) alive as long as the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from blockserve.attention.context import ForwardContext, StateMetadata
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.kv.specs import SlidingWindowSpec, cdiv
from blockserve.worker.input_batch import StepInputs
from blockserve.worker.kv_tensors import KVCacheTensors

Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_num_seqs, and max_num_seqs itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return (*sizes, max_num_seqs)


def graph_blockers(model: torch.nn.Module) -> list[str]:
    """Why `model`'s decode step cannot be captured (each reason once); empty if it can."""
    reasons = {}
    for module in model.modules():
        blocker = getattr(module, "cuda_graph_blocker", None)
        if blocker is not None and (reason := blocker()) is not None:
            reasons.setdefault(reason)
    return list(reasons)


def cuda_capture(device: torch.device) -> Capture:
    """Captures on `device`, all graphs in one memory pool (capture the largest first). Each forward
    runs twice on a side stream first: compilation, autotuning and allocations happen there."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()
        return graph.replay, output

    return capture


@dataclass
class _Graph:
    size: int
    inputs: torch.Tensor  # [size * len(fields)] int64 on the device: every per-row field, field after field
    tables: dict[int, torch.Tensor]  # per attention group, [size, its table capacity]: the shared tables' rows
    replay: Callable[[], None]
    output: torch.Tensor  # [size, hidden]
    # The captured forward, kept with the graph: a CUDA graph holds its kernels' pointers, not references,
    # so every tensor they read besides the inputs (the static metadata's, such as the rows' arange, and
    # what the backends derived while capturing) must live as long as the graph. Dropped, their memory
    # goes back to the allocator and replays read whatever is put there next.
    forward: Callable[[], torch.Tensor]


class DecodeGraphs:
    """The captured decode steps of `model` over the KV tensors `kv`, one per size in `sizes`."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheTensors, memo: dict, sizes: Sequence[int],
                 max_model_len: int, device: torch.device, capture: Capture):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"CUDA graph sizes must be positive batch sizes, got {list(sizes)}")
        self.model, self.kv, self.memo, self.device = model, kv, memo, torch.device(device)
        self.groups = kv.config.groups
        self.fields = ["input_ids", "positions"]  # one int64 per row each
        self.table_widths: dict[int, int] = {}  # per attention group: its tables' capacity (input_batch.py)
        for g, group in enumerate(self.groups):
            if group.is_state:
                self.fields.append(f"slots{g}")
            else:
                self.table_widths[g] = cdiv(max_model_len, group.spec.block_size)
                self.fields += [f"slot{g}", f"key_start{g}", f"seq_len{g}"]
        # One table per attention group for every graph: the largest capture (the KV budget's probe) holds them all.
        self.tables = {g: self._host_table(g, max(sizes), None).to(self.device) for g in self.table_widths}
        self.graphs: dict[int, _Graph] = {}
        for size in sorted(set(sizes), reverse=True):  # the largest first: the others reuse its memory
            self.graphs[size] = self._capture(size, capture)
        self.max_size = max(sizes)

    def covers(self, step: StepInputs) -> bool:
        """Whether `step` is a decode step a captured graph can run (every row one query token; no
        verified drafts where a state group runs them as chains, whose waves the graph does not hold)."""
        layout = step.layout
        if step.chains and any(isinstance(meta, StateMetadata) for meta in step.metadata):
            return False
        return 0 < layout.num_seqs == layout.num_decodes <= self.max_size

    def run(self, step: StepInputs, fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """The hidden states [n, hidden] of decode step `step` (host inputs; `covers(step)`); `fill`
        writes the input ids still in flight into the graph's input ids on the device."""
        n = step.layout.num_seqs
        graph = self.graphs[min(size for size in self.graphs if size >= n)]
        graph.inputs.copy_(self._host_inputs(graph.size, step), non_blocking=True)
        for g, table in graph.tables.items():
            step_table = self._host_table(g, graph.size, step)
            table[:, : step_table.shape[1]].copy_(step_table, non_blocking=True)
        if fill is not None:
            fill(graph.inputs[:n])  # input_ids is the first field
        graph.replay()
        return graph.output[:n]

    def _capture(self, size: int, capture: Capture) -> _Graph:
        inputs = self._host_inputs(size, None).to(self.device)
        tables = {g: table[:size] for g, table in self.tables.items()}
        views = self._views(inputs, size)
        layout = BatchLayout(list(range(size + 1)), [1] * size, size, views["positions"],
                             torch.arange(size, device=self.device))
        metadata: list[AttentionMetadata | StateMetadata] = []
        for g, group in enumerate(self.groups):
            if group.is_state:
                metadata.append(StateMetadata(layout, views[f"slots{g}"], {}, [0] * size))
                continue
            window = group.spec.sliding_window if isinstance(group.spec, SlidingWindowSpec) else None
            metadata.append(AttentionMetadata(layout, group.spec.block_size, tables[g], views[f"slot{g}"],
                                              views[f"key_start{g}"], views[f"seq_len{g}"], window,
                                              key_starts=[0] * size, static_shapes=True))
        ctx = ForwardContext(self.kv.layer_caches(), metadata, self.memo)
        model = self.model  # not self: the graph keeps forward, which must not keep the graphs (no cycle)

        def forward() -> torch.Tensor:
            for meta in metadata:  # what a backend derives is recomputed by every run, from the tensors
                if isinstance(meta, AttentionMetadata):
                    meta.derived.clear()
            return model(views["input_ids"], views["positions"], ctx)

        replay, output = capture(forward)
        return _Graph(size, inputs, tables, replay, output, forward)

    def _views(self, flat: torch.Tensor, size: int) -> dict[str, torch.Tensor]:
        """`flat`'s fields for a batch of `size` rows: [size] each."""
        return dict(zip(self.fields, flat.view(len(self.fields), size)))

    def _host_inputs(self, size: int, step: StepInputs | None) -> torch.Tensor:
        """The per-row inputs of a batch of `size` rows on the host: `step`'s rows, then padding (all
        padding for None); pinned on CUDA (the copy to the device does not wait for it)."""
        flat = torch.empty(size * len(self.fields), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        views = self._views(flat, size)
        n = 0 if step is None else step.layout.num_seqs
        views["input_ids"][n:] = 0
        views["positions"][n:] = 0
        if step is not None:
            views["input_ids"][:n] = step.input_ids
            views["positions"][:n] = step.positions
        for g, group in enumerate(self.groups):
            meta = None if step is None else step.metadata[g]
            scratch = self.kv.scratch_slot(g)
            if group.is_state:
                views[f"slots{g}"][n:] = scratch
                if meta is not None:
                    views[f"slots{g}"][:n] = meta.slots
                continue
            views[f"slot{g}"][n:] = scratch * group.spec.block_size
            views[f"key_start{g}"][n:] = 0
            views[f"seq_len{g}"][n:] = 1
            if meta is not None:
                views[f"slot{g}"][:n] = meta.slot_mapping
                views[f"key_start{g}"][:n] = meta.key_start
                views[f"seq_len{g}"][:n] = meta.seq_len
        return flat

    def _host_table(self, g: int, size: int, step: StepInputs | None) -> torch.Tensor:
        """Attention group g's block table for a batch of `size` rows on the host, as wide as `step`'s
        (the capacity for None): `step`'s rows, then padding rows whose one block is the scratch block;
        pinned on CUDA."""
        meta = None if step is None else step.metadata[g]
        width = self.table_widths[g] if meta is None else meta.block_table.shape[1]
        table = torch.empty(size, width, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        n = 0 if meta is None else meta.layout.num_seqs
        if meta is not None:
            table[:n] = meta.block_table
        table[n:] = 0
        table[n:, 0] = self.kv.scratch_slot(g)
        return table
