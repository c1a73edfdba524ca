"""The worker's persistent view of running requests, updated incrementally each step.

Each request owns a row of a per-group block-table tensor for as long as the worker holds it;
a step's table is one index of those rows, only as wide as its longest context needs (rounded up
to a power of two): a table's full width is max_model_len's, and gathering it whole would cost
every step in proportion to max_model_len, whatever the contexts served. Decodes go first
in the step's batch order so the attention backends can attend them in one call.

    SchedulerOutput ──update()──► rows, tables, tokens ──prepare()──► StepInputs
                                  (host)                  built on the host, moved to the
                                                          device in one copy per step
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockserve.attention.context import StateMetadata
from blockserve.attention.metadata import AttentionMetadata, BatchLayout, int64_tensor, to_device
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.specs import SlidingWindowSpec, cdiv
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler.output import SchedulerOutput
from blockserve.structured.matcher import GrammarMatcher
from blockserve.worker.sampling_batch import SamplingRow, has_penalty
from blockserve.worker.state_rollback import DeferredRollback


@dataclass
class CachedRequest:
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    num_computed: int  # tokens whose KV is written once the scheduled step has run
    table_lens: list[int]  # entries filled in this request's row, per group
    eos_token_id: int | None = None
    grammar: GrammarMatcher | None = None  # structured outputs: at the output tokens so far
    sampling_row: SamplingRow | None = None  # the runner's, made on the first sampled step
    # A tensor-parallel rank > 0 after scoring k drafts it does not sample: k, until the scheduler's
    # computed count (the next step that schedules the request) says how many were accepted.
    unverified_drafts: int = 0
    # ...and with recurrent-state layers, its slots' rollback, applied once that count is known.
    unverified_states: DeferredRollback | None = None
    # Whether sampling it reads the values of its output tokens so far (a grammar, a penalty), not just
    # their count: then the previous step's tokens must be back first (async scheduling).
    reads_output_ids: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.reads_output_ids = self.grammar is not None or has_penalty(self.params)


@dataclass
class StepInputs:
    request_ids: list[str]  # batch order: decodes (and verified drafts) first
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: list[AttentionMetadata | StateMetadata]  # per group
    layout: BatchLayout
    sample_ids: list[str]  # requests that sample a token this step
    # Each one's last token in the batch; for a request with k draft tokens (speculative decoding), its
    # last k + 1 tokens, in order: [len(sample_ids) + drafts in all].
    logits_indices: torch.Tensor
    # Per state group, (running slot, checkpoint slot): captures at the end of a segment, done
    # after the forward as copies (those inside a segment are in the metadata's `captures`).
    end_captures: dict[int, list[tuple[int, int]]]
    # Per request in batch order, where its tokens start ([len(request_ids) + 1]). The same as
    # layout.query_start but where a verified request's k + 1 tokens are k + 1 decodes in the layout.
    query_start: list[int]
    # Verified requests (speculative decoding) -> (first row in the layout, rows): k + 1 decode rows each.
    chains: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def to(self, device: torch.device) -> StepInputs:
        """These inputs on `device`, moved in one copy (itself on the CPU)."""
        return self if device.type == "cpu" else _on_device(self, device)


class InputBatch:
    """The running requests' rows and block tables, on the host."""

    def __init__(self, kv_config: KVCacheConfig, max_num_seqs: int, max_model_len: int):
        self.kv_config = kv_config
        self.tables = []
        for group in kv_config.groups:
            width = 1 if group.is_state else cdiv(max_model_len, group.spec.block_size)
            self.tables.append(torch.zeros(max_num_seqs, width, dtype=torch.int64))
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.requests: dict[str, CachedRequest] = {}

    def update(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids | out.preempted_request_ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                self.free_rows.append(request.row)
        # The block ids appended to the tables, per group (rows, columns, ids): written in one index per
        # group at the end (every request gains a block on the same step when their lengths align).
        writes: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in self.tables]
        for new in out.new_requests:
            if not self.free_rows:
                raise RuntimeError("more running requests than max_num_seqs rows")
            row = self.free_rows.pop()
            self.requests[new.request_id] = CachedRequest(
                row, new.prompt_token_ids, list(new.output_token_ids), new.sampling_params,
                new.num_computed_tokens, [0] * len(self.tables), new.eos_token_id, grammar=_grammar(new),
            )
            _append_blocks(self.requests[new.request_id], new.block_ids, writes)
        for cached in out.cached_requests:
            request = self.requests[cached.request_id]
            if request.unverified_drafts:
                self._settle_verification(cached.request_id, request, cached.num_computed_tokens)
            if request.num_computed != cached.num_computed_tokens:
                raise RuntimeError(
                    f"request {cached.request_id}: worker has {request.num_computed} computed tokens, "
                    f"scheduler {cached.num_computed_tokens}"
                )
            if any(cached.new_block_ids):  # most decode steps add none
                _append_blocks(request, cached.new_block_ids, writes)
        for table, (rows, columns, ids) in zip(self.tables, writes):
            if ids:
                table[int64_tensor(rows), int64_tensor(columns)] = int64_tensor(ids)

    def _settle_verification(self, request_id: str, request: CachedRequest, num_computed: int) -> None:
        """A rank that scored a verification without sampling it (tensor parallelism, rank > 0) learns its
        outcome from the scheduler's computed count: the request emitted its accepted drafts and one token
        of the target's (their ids unknown here, -1: this rank never samples), the rejected drafts leave
        its computed count, and its tables forget the blocks the scheduler freed, as rank 0's did."""
        k, request.unverified_drafts = request.unverified_drafts, 0
        accepted = num_computed - (request.num_computed - k)
        if not 0 <= accepted <= k:
            raise RuntimeError(f"request {request_id}: the scheduler has {num_computed} computed tokens after "
                               f"verifying {k} drafts, the worker {request.num_computed - k} to "
                               f"{request.num_computed}")
        request.output_token_ids.extend([-1] * (accepted + 1))
        request.num_computed = num_computed
        self.trim_tables(request)
        if request.unverified_states is not None:  # before this step's forward reads the slots
            request.unverified_states(accepted + 1)
            request.unverified_states = None

    def trim_tables(self, request: CachedRequest) -> None:
        """After a verification rejected drafts: forget the attention blocks past the request's tokens,
        which the scheduler freed (KVCacheManager.trim_slots, to the same length)."""
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        for group_id, group in enumerate(self.kv_config.groups):
            if not group.is_state:
                keep = cdiv(num_tokens, group.spec.block_size)
                request.table_lens[group_id] = min(request.table_lens[group_id], keep)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's flattened inputs, on the host (`StepInputs.to` moves them); advances each
        request's computed count. Runs once per step over every request, so it builds its tensors
        from flat lists (int64_tensor) and takes a shortcut on decode-only steps."""
        scheduled, token_ids = out.num_scheduled_tokens, out.scheduled_token_ids
        verifying = self._verifying(out)
        if max(scheduled.values()) == 1:  # decode-only: every request computes one token
            order = list(scheduled)
            query_lens = [1] * len(order)
            flat_ids = [token_ids[rid][0] for rid in order]
        else:
            decode_like = {rid for rid, n in scheduled.items() if n == 1} | verifying
            order = [rid for rid in scheduled if rid in decode_like] + [rid for rid in scheduled if rid not in decode_like]
            query_lens = [scheduled[rid] for rid in order]
            flat_ids = [t for rid in order for t in token_ids[rid]]
        requests = [self.requests[rid] for rid in order]
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        chains: dict[str, tuple[int, int]] = {}  # verified request -> (its first row in the layout, its rows)
        if verifying:  # each verified request's k + 1 tokens attend as k + 1 decodes of growing length
            seq_query_lens, computed, row_ids = [], [], []
            for rid, request, n in zip(order, requests, query_lens):
                if rid in verifying:
                    chains[rid] = (len(seq_query_lens), n)
                    seq_query_lens += [1] * n
                    computed += range(request.num_computed, request.num_computed + n)
                    row_ids += [request.row] * n
                else:
                    seq_query_lens.append(n)
                    computed.append(request.num_computed)
                    row_ids.append(request.row)
            layout = BatchLayout.build(seq_query_lens, computed)
        else:
            layout = BatchLayout.build(query_lens, [r.num_computed for r in requests])
            row_ids = [r.row for r in requests]
        longest = max(layout.seq_lens)
        input_ids = int64_tensor(flat_ids)
        rows = int64_tensor(row_ids)
        metadata: list[AttentionMetadata | StateMetadata] = []
        end_captures: dict[int, list[tuple[int, int]]] = {}
        for group_id, (group, table) in enumerate(zip(self.kv_config.groups, self.tables)):
            if group.is_state:
                slots = table[rows, 0]
                slot_ids = slots.tolist()
                inside: dict[int, list[tuple[int, int]]] = {}
                row_captures: list[tuple[int, int]] = []
                for rid, captures in out.state_captures.get(group_id, {}).items():
                    if rid in chains:  # the state after the chain's row that ends at `position`
                        first, n = chains[rid]
                        for position, slot in captures:
                            row = first + position - layout.seq_lens[first]
                            if not first <= row < first + n:
                                raise RuntimeError(f"request {rid}: a state capture at position {position} lies "
                                                   "outside its verified tokens")
                            row_captures.append((row, slot))
                        continue
                    i = _seq_index(order, chains, rid)
                    for position, slot in captures:
                        if position == layout.seq_lens[i]:
                            end_captures.setdefault(group_id, []).append((slot_ids[i], slot))
                        else:
                            inside.setdefault(i, []).append((position, slot))
                metadata.append(StateMetadata(layout, slots, inside, slot_ids, list(chains.values()), row_captures))
                continue
            window = group.spec.sliding_window if isinstance(group.spec, SlidingWindowSpec) else None
            bs, capacity = group.spec.block_size, table.shape[1]
            width = step_table_width(cdiv(longest, bs), capacity)
            metadata.append(AttentionMetadata.build(layout, table[rows, :width], bs, window, capacity))
        sample_ids, logits_indices = [], []
        query_ends = query_start[1:]
        drafts_of = out.spec_token_ids
        for rid, request, n, end in zip(order, requests, query_lens, query_ends):
            request.num_computed += n
            k = len(drafts_of[rid]) if drafts_of and rid in drafts_of else 0
            if request.num_computed - k == len(request.prompt_token_ids) + len(request.output_token_ids):
                sample_ids.append(rid)
                if k:
                    logits_indices += range(end - 1 - k, end)
                else:
                    logits_indices.append(end - 1)
        return StepInputs(order, input_ids, layout.positions, metadata, layout, sample_ids,
                          int64_tensor(logits_indices), end_captures, query_start, chains)

    def _verifying(self, out: SchedulerOutput) -> set[str]:
        """The requests whose step scores a decode and its drafts, to be attended as one decode per
        token: row i is a decode of context length num_computed + i + 1 (its KV and the earlier rows'
        are written before any row attends, as for every decode), so the step runs the decode kernels,
        not the prefill path, with the same causal result.
        A state group runs a verified request's rows as one chain (`StateMetadata.chains`)."""
        drafts_of = out.spec_token_ids
        if not drafts_of:
            return set()
        scheduled = out.num_scheduled_tokens
        return {rid for rid, drafts in drafts_of.items() if drafts and scheduled.get(rid) == len(drafts) + 1}


def _seq_index(order: list[str], chains: dict[str, tuple[int, int]], request_id: str) -> int:
    """Where request `request_id` (not verified) sits in the layout: its place in `order`, moved on by
    the extra rows of the verified requests before it (they come first, with the decodes)."""
    i = order.index(request_id)
    return i + sum(n - 1 for rid, (_, n) in chains.items() if order.index(rid) < i)


MIN_STEP_TABLE_WIDTH = 16  # columns: a Triton kernel specialises a row stride divisible by 16


def step_table_width(needed: int, capacity: int) -> int:
    """Columns of a step's table whose longest context has `needed` blocks: a power of two, at least
    MIN_STEP_TABLE_WIDTH and at most `capacity`, so that a step's shapes take few values (few
    kernel specialisations and compiles)."""
    return min(capacity, max(MIN_STEP_TABLE_WIDTH, 1 << (needed - 1).bit_length()))


def _append_blocks(request: CachedRequest, block_ids: Sequence[Sequence[int]],
                   writes: list[tuple[list[int], list[int], list[int]]]) -> None:
    """Append `block_ids` (per group) to the request's table rows: counted now, queued in `writes`."""
    for group_id, ids in enumerate(block_ids):
        if ids:
            start = request.table_lens[group_id]
            rows, columns, values = writes[group_id]
            rows += [request.row] * len(ids)
            columns += range(start, start + len(ids))
            values += ids
            request.table_lens[group_id] = start + len(ids)


def _on_device(step: StepInputs, device: torch.device) -> StepInputs:
    """`step` with its tensors on `device`, moved in one copy; each metadata keeps its host twin."""
    tensors = [step.input_ids, step.logits_indices, *step.layout.tensors()]
    for meta in step.metadata:
        tensors += [meta.slots] if isinstance(meta, StateMetadata) else list(meta.tensors())[2:]
    moved = iter(to_device(tensors, device))
    input_ids, logits_indices = next(moved), next(moved)
    layout = step.layout.with_tensors(next(moved), next(moved))
    metadata = []
    for meta in step.metadata:
        if isinstance(meta, StateMetadata):
            metadata.append(dataclasses.replace(meta, layout=layout, slots=next(moved)))
        else:
            device_meta = meta.with_tensors(*layout.tensors(), *(next(moved) for _ in range(4)))
            metadata.append(dataclasses.replace(device_meta, layout=layout))
    return dataclasses.replace(step, input_ids=input_ids, positions=layout.positions, metadata=metadata,
                               layout=layout, logits_indices=logits_indices)


def _grammar(new) -> GrammarMatcher | None:
    """A new (or re-admitted) request's grammar matcher, advanced past its output tokens so far (the one it
    comes with, if any)."""
    if new.grammar is not None:
        return new.grammar
    spec = new.sampling_params.structured_outputs
    if spec is None:
        return None
    if spec.compiled is None:
        raise RuntimeError(f"request {new.request_id}: structured_outputs reached the worker uncompiled; "
                           "add requests through LLMEngine, which compiles them")
    return GrammarMatcher(spec.compiled, new.output_token_ids)
