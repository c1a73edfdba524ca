"""Executes one SchedulerOutput: poison, state-restore copies and zero orders first, one
forward pass over the flattened batch (prefill chunks and decodes together, capturing state
checkpoints), then sampling.

    SchedulerOutput ─► update rows ─► poison, copy, zero (C1) ─► prepare inputs ─► model ─► sampler
                                                                                       │
                                                      ModelRunnerOutput (tokens, logprobs) ◄┘

On CUDA a decode step of at most the largest captured batch replays a CUDA graph instead of
running the model's forward eagerly (`capture_decode_graphs`, worker/cuda_graphs.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from blockserve.attention.context import ForwardContext
from blockserve.attention.metadata import to_device
from blockserve.kv.config import KVCacheConfig
from blockserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from blockserve.worker.cuda_graphs import Capture, DecodeGraphs, cuda_capture
from blockserve.worker.input_batch import CachedRequest, InputBatch
from blockserve.worker.kv_tensors import KVCacheTensors
from blockserve.worker.prompt_logprobs import PromptLogprobs
from blockserve.worker.sampler import Sampler, SamplingBatch, SamplingRow, make_generator


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

    def capture_decode_graphs(self, sizes, capture: Capture | None = None) -> None:
        """Capture the model's decode step at each batch size in `sizes` (the caller has checked
        cuda_graphs.graph_blockers); `capture`: how (default: CUDA graphs on this runner's device)."""
        capture = capture or cuda_capture(self.device)
        with torch.inference_mode():
            self.graphs = DecodeGraphs(self.model, self.kv, self.memo, sizes, self.max_model_len, self.device, capture)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        for rid in out.finished_request_ids:
            self.generators.pop(rid, None)
        self.batch.update(out)
        self.prompt_logprobs.update(out)
        for group_id, block_ids in out.blocks_to_poison.items():
            self.kv.poison_blocks(group_id, block_ids)
        for group_id, pairs in out.state_copies.items():
            self.kv.copy_slots(group_id, pairs)
        for group_id, block_ids in out.blocks_to_zero.items():
            self.kv.zero_blocks(group_id, block_ids)
        t1 = time.perf_counter()
        self.timings.zero += t1 - t0
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({})
        inputs = self.batch.prepare(out)
        t2 = time.perf_counter()
        if self.graphs is not None and self.graphs.covers(inputs):
            hidden = self.graphs.run(inputs)
            logits_indices = to_device(inputs.logits_indices, self.device)
        else:
            inputs = inputs.to(self.device)
            hidden = self.model(inputs.input_ids, inputs.positions,
                                ForwardContext(self.layer_caches, inputs.metadata, self.memo))
            logits_indices = inputs.logits_indices
        for group_id, pairs in inputs.end_captures.items():
            self.kv.copy_slots(group_id, pairs)
        logits = self.model.compute_logits(hidden[logits_indices]) if inputs.sample_ids else None
        self.prompt_logprobs.compute(self.model, hidden, inputs, self.batch.requests)
        t3 = time.perf_counter()
        sampled: dict[str, list[int] | tuple[()]] = dict.fromkeys(inputs.request_ids, ())  # () = none this step
        logprobs: dict[str, list] = {}
        requests = [self.batch.requests[rid] for rid in inputs.sample_ids]
        if logits is not None:
            rows = [request.sampling_row or self._sampling_row(rid, request)
                    for rid, request in zip(inputs.sample_ids, requests)]
            result = self.sampler(logits, SamplingBatch.build(rows, self.device))
            for rid, request, token, token_logprobs in zip(inputs.sample_ids, requests, result.token_ids,
                                                           result.logprobs):
                request.output_token_ids.append(token)
                if request.grammar is not None:
                    request.grammar.accept(token)
                sampled[rid] = [token]
                if token_logprobs is not None:
                    logprobs[rid] = [token_logprobs]
        else:  # a tensor-parallel rank > 0: rank 0 samples; count the token so lengths agree
            for request in requests:
                request.output_token_ids.append(-1)
        t4 = time.perf_counter()
        self.timings.prepare += t2 - t1
        self.timings.forward += t3 - t2
        self.timings.sample += t4 - t3
        self.timings.steps += 1
        prompt_logprobs = self.prompt_logprobs.take_all(inputs.sample_ids)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

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
