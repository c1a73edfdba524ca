"""Executes one SchedulerOutput: poison, state-restore copies and zero orders first, one
forward pass over the flattened batch (prefill chunks and decodes together, capturing state
checkpoints), then sampling.

    SchedulerOutput ─► update rows ─► poison, copy, zero (C1) ─► prepare inputs ─► model ─► sampler
                                                                                       │
                                                      ModelRunnerOutput (tokens, logprobs) ◄┘

On CUDA a decode step of at most the largest captured batch replays a CUDA graph instead of
running the model's forward eagerly (`capture_decode_graphs`, worker/cuda_graphs.py).

Multi-token prediction (worker/mtp_proposer.py): `hidden_outputs`, where set, is handed every step's
final hidden states after the forward (the target's, for its MTP layer; the MTP head's own, for its
chained drafts); `hidden_inputs`, where set, supplies the states a model takes with its tokens
(ForwardContext.hidden_inputs: the MTP head's).

Speculative decoding: a request with k draft tokens (`SchedulerOutput.spec_token_ids`) is sampled at
each of its last k + 1 positions, position i as if drafts[:i] were already its output (penalties,
min_tokens, its seeded generator's next draw, its grammar's mask after drafts[:i]); `result()`
keeps the drafts the target's own tokens confirm and the target's token after them
(spec_decode/acceptance.py), advances the grammar past those only, and takes the rejected drafts
back out of the request's computed count.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockserve.attention.context import ForwardContext
from blockserve.attention.metadata import int64_tensor, to_device
from blockserve.kv.config import KVCacheConfig
from blockserve.kv.tiers.store import TieredKVStore
from blockserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from blockserve.spec_decode.acceptance import num_accepted
from blockserve.worker.cuda_graphs import Capture, DecodeGraphs, cuda_capture
from blockserve.worker.input_batch import CachedRequest, InputBatch, StepInputs
from blockserve.worker.kv_tensors import KVCacheTensors
from blockserve.worker.prompt_logprobs import PromptLogprobs, read_entries
from blockserve.worker.sampler import SampledTokens, Sampler
from blockserve.worker.sampling_batch import GREEDY_TEMPERATURE, SamplingBatch, SamplingRow, make_generator
from blockserve.worker.state_rollback import StateRollback


@dataclass
class RunnerTimings:
    """Seconds spent per phase since start-up (for the benchmarks' step profile)."""

    zero: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    steps: int = 0

    @property
    def total(self) -> float:
        return self.zero + self.prepare + self.forward + self.sample


class ModelRunner:
    """Runs `model` on `device` (where its weights are): the KV tensors, the step's inputs, the
    sampler and the seeded generators all live there."""

    def __init__(self, model: torch.nn.Module, kv_config: KVCacheConfig, max_num_seqs: int, max_model_len: int,
                 seed: int | None = None, *, device: torch.device | str):
        self.model = model
        self.device = torch.device(device)
        self.kv = KVCacheTensors(kv_config, device=self.device)
        self.batch = InputBatch(kv_config, max_num_seqs, max_model_len)
        self.sampler = Sampler(device=self.device, seed=seed)
        self.generators: dict[str, torch.Generator] = {}  # seeded requests, kept across preemption
        self.layer_caches = self.kv.layer_caches()
        self.memo: dict = {}  # ForwardContext.memo: the model's settled inputs over layer_caches
        self.timings = RunnerTimings()
        self.prompt_logprobs = PromptLogprobs()  # requests that asked for them, until their prompt completes
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None  # captured decode steps (capture_decode_graphs)
        self.last: LaunchedStep | None = None  # the latest step launched: its samples feed in-flight inputs
        self.offload: TieredKVStore | None = None  # the second tier the save orders go to (kv/tiers/)
        # (request ids, query starts) in batch order -> the rows ForwardContext.hidden_inputs carries
        self.hidden_inputs: Callable[[list[str], list[int]], torch.Tensor] | None = None
        # (request ids, query starts, each one's first position, hidden [T, H]) after each forward
        self.hidden_outputs: Callable[[list[str], list[int], list[int], torch.Tensor], None] | None = None
        # Speculation with a proposer that samples its drafts: (request id) -> the distributions [k', V] its
        # drafts were drawn from (k' >= its drafts), or None where they were not sampled
        self.draft_distributions: Callable[[str], torch.Tensor | None] | None = None
        self.keep_distributions = False  # a sampling draft's runner: each sample's distribution in its output

    def capture_decode_graphs(self, sizes, capture: Capture | None = None) -> None:
        """Capture the model's decode step at each batch size in `sizes` (the caller has checked
        cuda_graphs.graph_blockers); `capture`: how (default: CUDA graphs on this runner's device)."""
        capture = capture or cuda_capture(self.device)
        with torch.inference_mode():
            self.graphs = DecodeGraphs(self.model, self.kv, self.memo, sizes, self.max_model_len, self.device, capture)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run step `out` and wait for its samples: `launch(out).result()`."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Start step `out` on the device and return without waiting for its samples (on the CPU the
        step has run when this returns). An input id of -1 (a decode whose input is still in flight,
        async scheduling) is taken on the device from the last launched step's samples."""
        t0 = time.perf_counter()
        for rid in out.finished_request_ids:
            self.generators.pop(rid, None)
        self.batch.update(out)
        self.prompt_logprobs.update(out)
        if out.blocks_to_save:  # before any order below can change a block
            self._save_blocks(out.blocks_to_save)
        for group_id, block_ids in out.blocks_to_poison.items():
            self.kv.poison_blocks(group_id, block_ids)
        for group_id, pairs in out.state_copies.items():
            self.kv.copy_slots(group_id, pairs)
        for group_id, loads in out.blocks_to_load.items():
            self.kv.load_blocks(group_id, loads)
        for group_id, block_ids in out.blocks_to_zero.items():
            self.kv.zero_blocks(group_id, block_ids)
        t1 = time.perf_counter()
        self.timings.zero += t1 - t0
        if out.total_num_scheduled_tokens == 0:
            return LaunchedStep.done(ModelRunnerOutput({}))
        inputs = self.batch.prepare(out)
        fill = self._in_flight_inputs(inputs)
        t2 = time.perf_counter()
        if self.graphs is not None and self.graphs.covers(inputs):
            hidden = self.graphs.run(inputs, fill)
            logits_indices = to_device(inputs.logits_indices, self.device)
        else:
            inputs = inputs.to(self.device)
            if fill is not None:
                fill(inputs.input_ids)
            given = None if self.hidden_inputs is None else self.hidden_inputs(inputs.request_ids, inputs.query_start)
            hidden = self.model(inputs.input_ids, inputs.positions,
                                ForwardContext(self.layer_caches, inputs.metadata, self.memo, given))
            logits_indices = inputs.logits_indices
        if self.hidden_outputs is not None:
            starts = inputs.query_start
            firsts = [self.batch.requests[rid].num_computed - (end - start)
                      for rid, start, end in zip(inputs.request_ids, starts, starts[1:])]
            self.hidden_outputs(inputs.request_ids, starts, firsts, hidden)
        for group_id, pairs in inputs.end_captures.items():
            self.kv.copy_slots(group_id, pairs)
        logits = self.model.compute_logits(hidden[logits_indices]) if inputs.sample_ids else None
        self.prompt_logprobs.compute(self.model, hidden, inputs, self.batch.requests)
        t3 = time.perf_counter()
        requests = [self.batch.requests[rid] for rid in inputs.sample_ids]
        drafts_of = out.spec_token_ids
        drafts = [drafts_of.get(rid) for rid in inputs.sample_ids] if drafts_of else [None] * len(requests)
        samples = sampled_ids = None
        if logits is not None:
            if self.last is not None and not self.last.read and any(r.reads_output_ids for r in requests):
                self.last.result()  # penalties and grammars read the output tokens so far
            rows = [request.sampling_row or self._sampling_row(rid, request)
                    for rid, request in zip(inputs.sample_ids, requests)]
            if drafts_of:
                rows = [r for rid, row, d in zip(inputs.sample_ids, rows, drafts)
                        for r in (_verification_rows(row, d, self._distributions_of(rid, row)) if d else (row,))]
            samples = self.sampler.sample(logits, SamplingBatch.build(rows, self.device), self.keep_distributions)
            sampled_ids, samples = samples.token_ids, samples.to_host_async()
        for request, d in zip(requests, drafts):  # counted now, the id written by result() (a rank > 0: rank 0
            if d is None:  # samples); a verified request's tokens are appended by result(), one or more
                request.output_token_ids.append(-1)
        t4 = time.perf_counter()
        self.timings.prepare += t2 - t1
        self.timings.forward += t3 - t2
        self.timings.sample += t4 - t3
        self.timings.steps += 1
        prompt_logprobs = self.prompt_logprobs.take_all(inputs.sample_ids)
        rollback = None
        if inputs.chains and any(group.is_state for group in self.kv.config.groups):
            rollback = StateRollback(inputs.chains, inputs.metadata, self.layer_caches)
        self.last = LaunchedStep(inputs.request_ids, inputs.sample_ids, requests, samples, sampled_ids,
                                 prompt_logprobs, drafts, self.batch.trim_tables, rollback)
        return self.last

    def _save_blocks(self, saves: dict[int, list[tuple[int, bytes]]]) -> None:
        """Copy each block out to the writer's queue; one the queue has no room for is dropped
        (the step never waits for the writer)."""
        store = self.offload
        if store is None:
            raise RuntimeError("save orders reached a model runner without a second tier")
        orders = [(group_id, block_id, key) for group_id, group in saves.items() for block_id, key in group]
        for i, (group_id, block_id, key) in enumerate(orders):
            try:
                nbytes = self.kv.block_nbytes(group_id)
                payload = self.kv.block_bytes(group_id, block_id) if store.has_room(nbytes) else None
            except BaseException:
                for _, _, unanswered in orders[i:]:  # every claim is answered, even by a failed step
                    store.release(unanswered)
                raise
            if payload is None:
                store.release(key, nbytes)
            else:
                store.submit(key, payload)

    def _in_flight_inputs(self, inputs: StepInputs) -> Callable[[torch.Tensor], None] | None:
        """What writes the step's in-flight input ids (-1 on the host) into its input ids on the device,
        from the last launched step's samples; None when every input id is known (always, unless the last
        step's result is still to be read: one step at a time it was read before this step was scheduled)."""
        last = self.last
        if last is None or last.read:
            return None
        num_decodes = inputs.layout.num_decodes
        holes = (inputs.input_ids[:num_decodes] < 0).nonzero().flatten().tolist()
        if not holes:
            return None
        sampled, ids, k = last.sampled_ids, inputs.request_ids, len(holes)
        if sampled is not None and holes[-1] == k - 1 and ids[:k] == last.sample_ids[:k] and not any(last.drafts):
            # Steady decode: the first k rows take the last step's first k samples, in the same order.
            def fill_in_order(input_ids: torch.Tensor) -> None:
                input_ids[:k].copy_(sampled[:k])

            return fill_in_order
        where = {} if sampled is None else last.row_of
        missing = [ids[i] for i in holes if ids[i] not in where]
        if missing:
            raise RuntimeError(f"requests {missing} have an input in flight, but the last step did not sample them")
        rows = [where[ids[i]] for i in holes]
        dst, src = to_device((int64_tensor(holes), int64_tensor(rows)), self.device)

        def fill(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, dst, sampled.index_select(0, src))

        return fill

    def _distributions_of(self, request_id: str, row: SamplingRow) -> torch.Tensor | None:
        """The distributions the request's drafts were drawn from, where they were sampled (the request
        samples too: a greedy one verifies by equality with the target's argmax)."""
        if self.draft_distributions is None:
            return None
        distributions = self.draft_distributions(request_id)
        return distributions if row.params.temperature >= GREEDY_TEMPERATURE else None

    def _sampling_row(self, request_id: str, request: CachedRequest) -> SamplingRow:
        """The request's SamplingRow, made on its first sampled step and kept with it (its token
        lists are the request's own, so the row follows them); a seeded request's generator
        outlives preemption in `generators`."""
        generator = None
        if request.params.seed is not None:
            generator = self.generators.get(request_id)
            if generator is None:
                generator = self.generators[request_id] = make_generator(request.params.seed, self.device)
        request.sampling_row = SamplingRow(request.params, request.prompt_token_ids, request.output_token_ids,
                                           generator, request.eos_token_id, request.grammar)
        return request.sampling_row


def _verification_rows(row: SamplingRow, drafts: list[int],
                       distributions: torch.Tensor | None = None) -> list[SamplingRow]:
    """The rows that score a request's k drafts: row i samples as if drafts[:i] were already output,
    under the grammar's mask after drafts[:i] where the request has one (GrammarMatcher.draft_masks:
    a draft the grammar refuses is outside its position's mask, so it is never accepted). With
    `distributions` (the [k', V] the drafts were drawn from, k' >= k), row i < k verifies draft i by
    rejection sampling (SamplingRow.draft); without, row i's own sample is compared with draft i."""
    output = list(row.output_token_ids)
    masks = row.grammar.draft_masks(drafts) if row.grammar is not None else [None] * (len(drafts) + 1)
    sampled = [] if distributions is None else list(zip(drafts, distributions))
    return [dataclasses.replace(row, output_token_ids=output + drafts[:i], grammar=mask,
                                draft=sampled[i] if i < len(sampled) else None)
            for i, mask in enumerate(masks)]


class LaunchedStep:
    """A step launched on the device. `result()` waits for its samples, writes them into the worker's
    requests (where `launch` counted them as -1), advances their grammars and returns the step's
    ModelRunnerOutput; later calls return the same output."""

    def __init__(self, request_ids: list[str], sample_ids: list[str], requests: list[CachedRequest],
                 samples: SampledTokens | None, sampled_ids: torch.Tensor | None, prompt_logprobs: dict,
                 drafts: list[list[int] | None] | None = None,
                 trim_tables: Callable[[CachedRequest], None] | None = None,
                 rollback: StateRollback | None = None):
        self.request_ids, self.sample_ids, self.requests = request_ids, sample_ids, requests
        self.drafts = drafts or [None] * len(requests)  # per sampled request: its draft tokens, if any
        self.trim_tables = trim_tables  # after rejected drafts: InputBatch.trim_tables
        self.rollback = rollback  # recurrent-state layers: their slots back to the last accepted token
        self.samples = samples  # on their way to the host; None on a tensor-parallel rank > 0
        self.sampled_ids = sampled_ids  # [len(sample_ids)] on the device: the next step's in-flight inputs
        self.prompt_logprobs = prompt_logprobs  # of requests whose prompt completed, read by result()
        # Where each sampled request's token goes: the -1 launch appended for it.
        self.slots = [len(request.output_token_ids) - 1 for request in requests]
        self._output: ModelRunnerOutput | None = None

    @functools.cached_property
    def row_of(self) -> dict[str, int]:
        """Each sampled request's row in the samples. A request that verified k drafts owns k + 1 rows
        and has none: its next input is not known until its accepted count is back."""
        rows, row = {}, 0
        for rid, drafts in zip(self.sample_ids, self.drafts):
            if not drafts:
                rows[rid] = row
            row += len(drafts) + 1 if drafts else 1
        return rows

    @property
    def read(self) -> bool:
        """Whether result() has been called."""
        return self._output is not None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> LaunchedStep:
        step = cls([], [], [], None, None, {})
        step._output = output
        return step

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        sampled: dict[str, list[int] | tuple[()]] = dict.fromkeys(self.request_ids, ())  # () = none this step
        logprobs: dict[str, list] = {}
        if self.samples is not None:
            host = self.samples.host()
            if any(self.drafts):
                self._verify(host, sampled, logprobs)
            else:
                self._read(host, sampled, logprobs)
        else:  # a tensor-parallel rank > 0: the accepted count comes with the request's next step
            for request, drafts in zip(self.requests, self.drafts):
                if drafts:
                    request.unverified_drafts = len(drafts)
        prompt_logprobs = {rid: read_entries(entries) for rid, entries in self.prompt_logprobs.items()}
        kept = None if self.samples is None or any(self.drafts) else self.samples.distributions
        distributions = {} if kept is None else {rid: kept[i] for i, rid in enumerate(self.sample_ids)}
        self._output = ModelRunnerOutput(sampled, logprobs, prompt_logprobs, distributions)
        return self._output

    def _read(self, host, sampled: dict, logprobs: dict) -> None:
        """One token per sampled request."""
        for rid, request, slot, token, token_logprobs in zip(self.sample_ids, self.requests, self.slots,
                                                             host.token_ids, host.logprobs):
            request.output_token_ids[slot] = token
            if request.grammar is not None:
                request.grammar.accept(token)
            sampled[rid] = [token]
            if token_logprobs is not None:
                logprobs[rid] = [token_logprobs]

    def _verify(self, host, sampled: dict, logprobs: dict) -> None:
        """A request with drafts owns len(drafts) + 1 rows: it emits the accepted drafts and the target's
        token after them, and its computed count loses the rejected drafts."""
        row = 0
        for rid, request, slot, drafts in zip(self.sample_ids, self.requests, self.slots, self.drafts):
            width = len(drafts) + 1 if drafts else 1
            targets = host.token_ids[row:row + width]
            emitted = targets[:num_accepted(drafts, targets) + 1] if drafts else targets
            if drafts:
                request.output_token_ids.extend(emitted)
                request.num_computed -= width - len(emitted)
                self.trim_tables(request)
                if self.rollback is not None:
                    self.rollback(rid, len(emitted))
            else:
                request.output_token_ids[slot] = emitted[0]
            if request.grammar is not None:
                for token in emitted:
                    request.grammar.accept(token)
            sampled[rid] = emitted
            if host.logprobs[row] is not None:
                logprobs[rid] = host.logprobs[row:row + len(emitted)]
            row += width
        if self.rollback is not None:
            self.rollback.release()
            self.rollback = None
