"""The engine core: a loaded model, its KV cache, the scheduler and the model runner, stepped.

Start-up derives everything once: the model declares a KV spec per layer; layers with equal
specs form a group; each group's zero flag comes from its spec and the attention backend in
use (C1); the memory budget becomes a pool size per group, reported before serving.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch

from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.config import EngineConfig
from blockserve.engine.device import DEFAULT_GPU_MEMORY_UTILIZATION, DevicePlan, resolve_device_plan
from blockserve.engine.kv_budget import cuda_kv_budget, fixed_cuda_kv_bytes, graph_probe, profile_step
from blockserve.engine.kv_offload import build_kv_offload, offload_sizes
from blockserve.engine.thread_governor import ThreadGovernor
from blockserve.errors import EngineDead
from blockserve.kv.capacity import plan_kv_cache, plan_with_proposer
from blockserve.kv.manager import KVCacheManager
from blockserve.kv.specs import QUANTIZED_KV_DTYPES, SlidingWindowSpec
from blockserve.models.loader import LoadedModel, load_model
from blockserve.models.mtp import load_mtp
from blockserve.models.weight_memory import weight_memory_report
from blockserve.scheduler.config import SchedulerConfig
from blockserve.scheduler.output import RequestOutput, SchedulerOutput, SchedulerStats
from blockserve.scheduler.request import Request, RequestStatus
from blockserve.scheduler.scheduler import Scheduler
from blockserve.spec_decode.proposer import draft_seed
from blockserve.spec_decode.speculator import Speculator
from blockserve.worker.cuda_graphs import default_graph_sizes, graph_blockers
from blockserve.worker.draft_proposer import DraftModelProposer, check_draft_vocabulary
from blockserve.worker.mtp_proposer import MTPProposer
from blockserve.worker.model_runner import LaunchedStep, ModelRunner
from blockserve.worker.runner_proposer import RunnerProposer

logger = logging.getLogger("blockserve")

DEFAULT_MAX_MODEL_LEN_CAP = 8192
# Async scheduling with speculation: after a step without drafts, the steps run ahead (no drafts: every
# request has a token in flight) this many times before one waits for its tokens to probe for drafts;
# doubled after each probe that finds none, back to the first after a step with drafts.
FIRST_AHEAD_STEPS = 4
MAX_AHEAD_STEPS = 32  # a probe costs one step's overlap: at most 1 in 33 steps
T = TypeVar("T")


def load_model_for(config: EngineConfig, plan: DevicePlan | None = None) -> LoadedModel:
    """The model `config` names, loaded as it says on `plan`'s device and dtype (default: resolved
    from `config`; torch threads set first, so loading uses them)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    plan = plan or resolve_device_plan(config.device, config.dtype, config.gpu_memory_utilization)
    return load_model(config.model, BACKENDS[config.attention_backend], quantized_matmul=config.quantized_matmul,
                      quantized_activations=config.quantized_activations,
                      quantized_max_rows=config.quantized_max_rows,
                      placement=plan.placement)


def engine_device_plan(config: EngineConfig, loaded: LoadedModel | None) -> DevicePlan:
    """config's device plan; with a model loaded already, the model's device and dtype (an explicit
    config.device or config.dtype that disagrees is a ValueError). Tensor parallelism runs on the
    CPU (gloo): device auto means cpu there."""
    tp = config.tensor_parallel_size > 1
    device = "cpu" if tp and config.device == "auto" else config.device
    plan = resolve_device_plan(device, config.dtype, config.gpu_memory_utilization)
    if tp and (plan.device.type != "cpu" or plan.dtype != torch.float32):
        raise ValueError(f"tensor parallelism runs on the CPU in float32 (gloo), but device={config.device!r} and "
                         f"dtype={config.dtype!r} resolve to {plan.device} / {plan.dtype}: pass --device cpu "
                         "--dtype float32, or tensor_parallel_size=1")
    if loaded is None:
        return plan
    weight = next(loaded.model.parameters())
    placement = getattr(loaded.model, "placement", None)  # a CausalLM's: its dtype, whatever 16-bit weights it kept
    dtype = weight.dtype if placement is None else placement.dtype
    if config.device != "auto" and weight.device.type != plan.device.type:
        raise ValueError(f"device={config.device!r} but the model passed in is on {weight.device}")
    if config.dtype != "auto" and dtype != plan.dtype:
        raise ValueError(f"dtype={config.dtype!r} but the model passed in is in {dtype}")
    if config.dtype != "auto" and placement is not None and placement.keep_16bit_weights:
        raise ValueError(f"dtype={config.dtype!r} but the model passed in keeps its 16-bit weights (loaded with "
                         "dtype auto on the CPU); load it with that dtype, or pass dtype='auto'")
    utilization = plan.gpu_memory_utilization if weight.device.type == "cuda" else None
    if utilization is None and weight.device.type == "cuda":
        utilization = DEFAULT_GPU_MEMORY_UTILIZATION
    return DevicePlan(weight.device, dtype, utilization,
                      keep_16bit_weights=placement is not None and placement.keep_16bit_weights)


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    """config.max_model_len, or the model's maximum capped at DEFAULT_MAX_MODEL_LEN_CAP; ValueError
    if the one asked for exceeds the model's positions."""
    model_max = getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN_CAP)
    max_model_len = config.max_model_len or min(model_max, DEFAULT_MAX_MODEL_LEN_CAP)
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's maximum of {model_max} positions")
    return max_model_len


class RunnerFailed(RuntimeError):
    """The model runner raised in a step. `request_ids` were scheduled in it: their KV for the
    step may be partly written, so they cannot go on; every other request is untouched."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"the model runner failed in a step of {len(request_ids)} request(s)")
        self.request_ids = request_ids


def _run(work: Callable[[], T], *steps: SchedulerOutput) -> T:
    """work(); if it raises, a RunnerFailed for the requests of `steps` (an EngineDead as it is: a
    tensor-parallel rank failed, which is fatal for every request)."""
    try:
        return work()
    except EngineDead:
        raise
    except Exception as e:
        raise RunnerFailed(list(dict.fromkeys(rid for step in steps for rid in step.num_scheduled_tokens))) from e


def refuse_unreadable_kv_dtype(layer_name: str, module, spec, device: torch.device) -> None:
    """A quantized K/V dtype must be one the layer's attention backend declares it reads and writes
    (`quantized_kv_dtypes`) and, where the backend says why one cannot be read on a device
    (`unreadable_kv_dtype(dtype, device)`), readable on `device`; otherwise start-up fails naming
    both, never a silent fallback nor a failure at the first step (C7)."""
    if not getattr(spec, "is_quantized", False):
        return
    backend = getattr(module, "backend", None)
    readable = getattr(backend, "quantized_kv_dtypes", ())
    for dtype in dict.fromkeys((spec.dtype, spec.value_dtype)):
        if dtype not in QUANTIZED_KV_DTYPES:
            continue
        reader = f"attention backend {backend.name!r}" if backend is not None else type(module).__name__
        if dtype not in readable:
            raise ValueError(f"kv_cache_dtype {dtype!r} cannot be read by {reader} (layer {layer_name}); "
                             f"use attention_backend 'exact', 'whole_block' or 'flex', or a float kv_cache_dtype")
        unreadable = getattr(backend, "unreadable_kv_dtype", None)
        if unreadable is not None and (why := unreadable(dtype, device)):
            raise ValueError(f"kv_cache_dtype {dtype!r} cannot be read by {reader} on {device} "
                             f"(layer {layer_name}): {why}")


class ProposerModel(NamedTuple):
    """A draft model or MTP head, loaded, before its KV cache is planned."""

    proposer: type  # DraftModelProposer or MTPProposer
    model: torch.nn.Module
    kv_groups: list  # as kv_groups_of gives them
    field: str  # the option that asked for it, in errors
    kind: str  # "draft model", "MTP head"
    name: str  # heads its start-up report


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """The engine over `config`; if building it fails once tensor-parallel ranks are up, they
        are stopped before the original error propagates (never left for the garbage collector)."""
        self.executor = None  # tensor parallel: ranks 1..N-1 and rank 0's shard (distributed/executor.py)
        self.kv_offload = None  # the second prefix-cache tier (engine/kv_offload.py)
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # async scheduling's step ahead
        self._in_flight_began = 0.0  # when it was launched (perf_counter)
        # Async scheduling with speculation: steps run ahead since the last with drafts, and how many may.
        self._ahead_steps = self._ahead_limit = FIRST_AHEAD_STEPS
        try:
            self._build(config, loaded)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        self.config = config
        self.device_plan = plan = engine_device_plan(config, loaded)
        if config.cuda_graph_sizes and not plan.is_cuda:
            raise ValueError(f"cuda_graph_sizes applies on CUDA only; this engine runs on {plan.device}")
        if config.async_scheduling and not plan.is_cuda:
            logger.warning("async scheduling on %s: the forward runs inside the launch, so nothing overlaps, and "
                           "each step's tokens come back a step later (it pays on CUDA only)", plan.device)
        if (why := BACKENDS[config.attention_backend].unavailable(plan.device)) is not None:
            raise ValueError(f"attention_backend {config.attention_backend!r} cannot run on {plan.device}: {why}")
        if config.tensor_parallel_size > 1:
            from blockserve.distributed.executor import TensorParallelExecutor

            self.executor = TensorParallelExecutor(config, loaded)
            loaded = self.executor.loaded
        elif loaded is None:
            loaded = load_model_for(config, plan)
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded
        weights_line = weight_memory_report(loaded.model)  # before the KV cache is allocated: the load's peak
        self.max_model_len = max_model_len = resolve_max_model_len(config, loaded.hf_config)

        model = self.loaded.model
        kv_groups = kv_groups_of(model, config, plan.device)
        scheduler_config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_prefill_chunk=config.max_prefill_chunk,
            policy=config.scheduling_policy,
        )
        graph_sizes = self._decode_graph_sizes(config) if plan.is_cuda else ()
        self.kv_budget = None  # CUDA: how gpu_memory_utilization was spent (kv_budget.py)
        if self.executor is not None:
            kv_bytes = self.executor.kv_memory_bytes
        elif plan.is_cuda and config.kv_cache_memory is not None:  # a fixed size
            kv_bytes = fixed_cuda_kv_bytes(config.kv_cache_memory, plan.device)
        elif plan.is_cuda:  # what gpu_memory_utilization leaves after a profiling forward of the largest step
            tokens = min(config.max_num_batched_tokens, max_model_len - 1)
            probe = (lambda: graph_probe(model, kv_groups, tokens, max(graph_sizes), plan.device, max_model_len)) \
                if graph_sizes else None
            self.kv_budget = cuda_kv_budget(plan.device, plan.gpu_memory_utilization,
                                            lambda: profile_step(model, kv_groups, tokens, plan.device), probe)
            kv_bytes = self.kv_budget.kv_bytes
        else:
            kv_bytes = config.kv_cache_bytes()
        proposer_model = self._proposer_model(config)  # a draft model or MTP head: its KV from the same budget
        plan_args = (kv_bytes, max_model_len, config.max_num_seqs, scheduler_config.chunk_cap)
        plan_options = dict(checkpoint_share=config.state_checkpoint_share,
                            enable_prefix_caching=config.enable_prefix_caching,
                            poison_freed_blocks=config.poison_enabled,
                            checkpoint_interval=config.state_checkpoint_interval,
                            checkpoint_savings_weight=config.state_checkpoint_savings_weight)
        proposer_kv_config = None
        if proposer_model is None:
            self.kv_config = plan_kv_cache(kv_groups, *plan_args, **plan_options)
        else:
            try:
                self.kv_config, proposer_kv_config = plan_with_proposer(
                    kv_groups, proposer_model.kv_groups, *plan_args,
                    proposer_caching=proposer_model.proposer.caches_prefixes, **plan_options)
            except ValueError as e:
                raise ValueError(f"{proposer_model.field}: the {proposer_model.kind}'s KV cache is drawn from the "
                                 f"target's budget: {e}") from e
        if config.unsafe_disable_zeroing:
            groups_off = tuple(dataclasses.replace(g, zero_new_blocks=False) for g in self.kv_config.groups)
            self.kv_config = dataclasses.replace(self.kv_config, groups=groups_off)
            logger.warning("zeroing of new KV blocks is disabled: outputs may be corrupted (C1 tests only)")
        runner_args = (self.kv_config, config.max_num_seqs, max_model_len, config.seed)
        rank_fingerprints = None
        if self.executor is not None:  # the ranks' runners and second-tier stores first: rank 0's store needs
            # every rank's fingerprint
            sizes = offload_sizes(config, self.kv_config) if config.kv_offload_enabled else None
            self.runner = self.executor.start(*runner_args, dtype=plan.dtype, offload_sizes=sizes)
            rank_fingerprints = self.executor.rank_fingerprints
        # A second prefix-cache tier (disk, host memory), if asked for: closed with the engine.
        self.kv_offload = build_kv_offload(config, self.kv_config, model, plan.dtype, rank_fingerprints)
        proposer_kv = None if proposer_kv_config is None else KVCacheManager(proposer_kv_config)
        self.kv = KVCacheManager(self.kv_config, self.kv_offload, _companion(proposer_model, proposer_kv))
        if config.enable_prefix_caching and not self.kv.caching_possible:
            logger.warning("prefix caching is on but the KV budget leaves no room for recurrent-state "
                           "checkpoints (state_checkpoint_share=%s): this model will get no prefix hits",
                           config.state_checkpoint_share)
        speculator = self._speculator(config, proposer_model, proposer_kv, scheduler_config.chunk_cap)
        self.scheduler = Scheduler(scheduler_config, self.kv, speculator)
        self.check_integrity = config.check_enabled  # read once: the environment is not re-read every step
        proposer = getattr(self.scheduler.speculator, "proposer", None)
        # A draft model's or MTP head's own cache (C3 checks it beside the target's).
        self.proposer_kv = proposer.kv if isinstance(proposer, RunnerProposer) else None
        if self.executor is None:
            self.runner = ModelRunner(self.loaded.model, *runner_args, device=plan.device)
        target_runner = self.target_runner  # rank 0's under TP (self.runner is then the executor)
        if isinstance(proposer, MTPProposer):  # the MTP head drafts from the target's (whole) hidden states
            target_runner.hidden_outputs = proposer.record
        if isinstance(proposer, RunnerProposer):  # sampled drafts: verified by rejection sampling
            target_runner.draft_distributions = proposer.take_distributions
        if self.kv_offload is not None:  # rank 0's saves
            target_runner.offload = self.kv_offload
            if self.executor is not None:  # and the other ranks' writes in its stats
                self.kv_offload.peers = self.executor.rank_writer_counts
        self.thread_governor = None  # one process on the CPU: fewer threads while the cores are busy
        if self.executor is None and plan.device.type == "cpu" and config.adaptive_threads:
            self.thread_governor = ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
        budget_line = "" if self.kv_budget is None else f"\n{self.kv_budget.report()}"
        logger.info("KV cache capacity (max_model_len %d, %s, %s):\n%s%s\n%s", max_model_len, plan.device,
                    str(plan.dtype).removeprefix("torch."), self.kv_config.capacity_report(), budget_line,
                    weights_line)
        if graph_sizes:
            began, reserved = time.perf_counter(), torch.cuda.memory_reserved(plan.device)
            self.runner.capture_decode_graphs(graph_sizes)
            torch.cuda.empty_cache()  # the warm-up runs' activations; the graphs' pool stays
            held = torch.cuda.memory_reserved(plan.device) - reserved
            budgeted = 0 if self.kv_budget is None else self.kv_budget.graphs
            logger.info("CUDA graphs: decode captured at batch sizes %s in %.1f s, holding %.2f GiB (%.2f GiB "
                        "budgeted)", sorted(set(graph_sizes)), time.perf_counter() - began, held / 2**30,
                        budgeted / 2**30)

    @property
    def target_runner(self) -> ModelRunner | None:
        """The target's ModelRunner in this process (rank 0's under tensor parallelism); None before it is
        built and once closed."""
        return getattr(self, "runner", None) if self.executor is None else self.executor.runner

    def _speculator(self, config: EngineConfig, proposer_model: ProposerModel | None,
                    proposer_kv: KVCacheManager | None, chunk_cap: int) -> Speculator | None:
        """The speculator `config.speculative_config` asks for (recurrent-state layers included: their
        slots are rolled back to the last accepted draft, worker/state_rollback.py). A draft model or MTP
        head drafts on KV groups of its own (`proposer_kv`, planned with the target's from one budget,
        zeroed and poisoned like the target's; a draft model's allocated with the target's and
        prefix-cached where the target's is, an MTP head's never) through a ModelRunner of its own,
        seeded apart from the target's."""
        spec = config.speculative_config
        if spec is None:
            return None
        if proposer_model is None:
            return Speculator(spec)
        model = proposer_model.model
        runner = ModelRunner(model, proposer_kv.config, config.max_num_seqs, self.max_model_len,
                             draft_seed(config.seed), device=self.device_plan.device)
        logger.info("%s, its KV cache (from the target's budget):\n%s\n%s", proposer_model.name,
                    proposer_kv.capacity_report(), weight_memory_report(model))
        return Speculator(spec, proposer_model.proposer(runner, proposer_kv, chunk_cap))

    def _proposer_model(self, config: EngineConfig) -> ProposerModel | None:
        """The draft model or MTP head `config.speculative_config` asks for, loaded (None for the other
        methods)."""
        spec = config.speculative_config
        if spec is None or spec.method not in ("draft_model", "mtp"):
            return None
        if spec.method == "mtp":  # under tensor parallelism, whole on rank 0 (models/mtp.py)
            head = load_mtp(self.loaded.model, config.model)
            return ProposerModel(MTPProposer, head, kv_groups_of(head, config, self.device_plan.device),
                                 "speculative_config.method 'mtp'", "MTP head", f"MTP head of {self.loaded.source}")
        return self._draft_model(config)

    def _draft_model(self, config: EngineConfig) -> ProposerModel:
        """speculative_config.model loaded like the target (device, dtype, attention backend, quantized
        kernels), checked against its vocabulary and its positions. One with recurrent-state layers
        puts its slots back after each proposal's chained drafts (worker/runner_proposer.py)."""
        path = config.speculative_config.model
        try:
            draft = load_model(path, BACKENDS[config.attention_backend], quantized_matmul=config.quantized_matmul,
                               quantized_activations=config.quantized_activations,
                               quantized_max_rows=config.quantized_max_rows, placement=self.device_plan.placement)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config.model {path!r} does not load: {e}") from e
        check_draft_vocabulary(self.loaded.hf_config, self.loaded.tokenizer, draft.hf_config, draft.tokenizer)
        draft_len = getattr(draft.hf_config, "max_position_embeddings", None)
        if draft_len is not None and draft_len < self.max_model_len:
            raise ValueError(f"speculative_config.model: the draft holds {draft_len} positions, fewer than "
                             f"max_model_len={self.max_model_len}; lower max_model_len or use a longer draft")
        groups = kv_groups_of(draft.model, config, self.device_plan.device)
        return ProposerModel(DraftModelProposer, draft.model, groups, "speculative_config.model", "draft model",
                             f"draft model {draft.source}")

    def _decode_graph_sizes(self, config: EngineConfig) -> tuple[int, ...]:
        """CUDA: the batch sizes to capture decode steps at; none with enforce_eager, or when some layer
        cannot be captured (then a warning, or a ValueError if cuda_graph_sizes asked for them)."""
        if config.enforce_eager:
            logger.info("CUDA graphs: off (enforce_eager); every step runs eagerly")
            return ()
        blockers = graph_blockers(self.loaded.model)
        if blockers:
            if config.cuda_graph_sizes:
                raise ValueError("cuda_graph_sizes given, but this model's decode cannot be captured: "
                                 + "; ".join(blockers))
            logger.warning("CUDA graphs: off, decode steps run eagerly: %s", "; ".join(blockers))
            return ()
        return tuple(config.cuda_graph_sizes or default_graph_sizes(config.max_num_seqs))

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (a ValueError) if it can never be served."""
        self.scheduler.add_request(request)

    def step(self) -> tuple[list[RequestOutput], SchedulerStats]:
        """One step; RunnerFailed (its cause chained) if the model runner raised. With async
        scheduling a step launches the next step and returns the outputs of the one before."""
        if self.thread_governor is not None and (threads := self.thread_governor.tick()) is not None:
            logger.info("torch threads: %d of %d (the cores other processes leave free)", threads,
                        self.thread_governor.max_threads)
        if self.runner is None:
            raise RuntimeError("this engine is closed: build a new one")
        began = time.perf_counter()
        settled = self._settle_for_drafts() if self.config.async_scheduling else None
        scheduler_output = self.scheduler.schedule()
        if self.config.async_scheduling:
            if settled is not None:
                self._note_drafts(scheduler_output, probed=settled[1])
            outputs = self._step_ahead(scheduler_output)
            if settled:
                outputs = settled[0] + outputs
            stats = self.scheduler.stats(scheduler_output.total_num_scheduled_tokens)
        else:
            runner_output = _run(lambda: self.runner.execute(scheduler_output), scheduler_output)
            outputs, stats = self.scheduler.update_from_output(scheduler_output, runner_output)
            speculator = self.scheduler.speculator
            if speculator is not None and _decodes_only(scheduler_output):  # what speculation weighs its drafts by
                speculator.observe_step(scheduler_output.total_num_scheduled_tokens, time.perf_counter() - began)
        if self.check_integrity:
            self.check_kv_integrity()
        return outputs, stats

    def check_kv_integrity(self) -> None:
        """C3: AssertionError unless the KV cache's books balance, and a draft model's or MTP head's own."""
        self.kv.check_integrity()
        if self.proposer_kv is not None:
            self.proposer_kv.check_integrity()

    def _settle_for_drafts(self) -> tuple[list[RequestOutput], bool] | None:
        """Async scheduling with speculation: a step is scheduled with drafts only where the request's
        tokens are all back (a draft follows the last token, and the accepted count moves every later
        position). So before scheduling, wait for the step in flight and apply its tokens when it
        verified drafts (its accepted counts must be back anyway) or when a probe is due; otherwise
        run ahead without drafts. Returns (the settled step's outputs, whether it was a probe), or
        None without speculation. Exact either way: drafts are never scheduled over a token in flight."""
        speculator = self.scheduler.speculator
        if speculator is None:
            return None
        if self._in_flight is None:
            return [], False
        previous = self._in_flight
        probe = not previous[0].spec_token_ids
        if probe and self._ahead_steps < self._ahead_limit:
            self._ahead_steps += 1
            return [], False
        self._in_flight = None
        runner_output = _run(previous[1].result, previous[0])
        if _decodes_only(previous[0]):  # launched, then waited for at once: one step's time
            speculator.observe_step(previous[0].total_num_scheduled_tokens,
                                    time.perf_counter() - self._in_flight_began)
        outputs, _ = self.scheduler.update_from_output(previous[0], runner_output)
        return outputs, probe

    def _note_drafts(self, scheduler_output: SchedulerOutput, probed: bool) -> None:
        """After scheduling a step: with drafts in it, the next step settles it first; a probe that found
        none lets twice as many steps run ahead before the next."""
        if scheduler_output.spec_token_ids:
            self._ahead_steps, self._ahead_limit = 0, FIRST_AHEAD_STEPS
        elif probed:
            self._ahead_steps, self._ahead_limit = 0, min(2 * self._ahead_limit, MAX_AHEAD_STEPS)

    def _step_ahead(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """Async scheduling: launch `scheduler_output`, then wait for the step launched before it and
        apply its tokens while the device runs the new one. A failure takes both steps' requests."""
        began = time.perf_counter()
        previous, self._in_flight = self._in_flight, None
        both = (scheduler_output,) if previous is None else (scheduler_output, previous[0])
        launched = _run(lambda: self.runner.launch(scheduler_output), *both)
        outputs = []
        if previous is not None:
            runner_output = _run(previous[1].result, *both)
            outputs, _ = self.scheduler.update_from_output(previous[0], runner_output)
        if not scheduler_output.is_empty:
            self._in_flight = (scheduler_output, launched)
            self._in_flight_began = began
        return outputs

    def abort(self, request_ids) -> list[str]:
        return self.scheduler.abort(request_ids)

    def finish(self, request_ids) -> list[str]:
        """End requests as stopped from outside the scheduler (a stop string matched in their
        text); their blocks are freed before the next step. Idempotent; returns the ids it ended."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_work(self) -> bool:
        return self.scheduler.has_pending_work() or self._in_flight is not None

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any, and let go of the model, the KV cache and the CUDA
        graphs, so the device memory they held is free for what runs next (the next engine of a test
        or a notebook; on CUDA it goes back to the device). Idempotent; the engine serves nothing after."""
        if self.executor is not None:
            self.executor.close()
        if self.kv_offload is not None:
            self.kv_offload.close()  # writes what is queued, joins the writer
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and scheduler.speculator is not None:
            scheduler.speculator.close()
        runner = self.target_runner
        if isinstance(runner, ModelRunner):
            runner.hidden_outputs = None  # the MTP proposer's, which would keep it and its states alive
        plan = getattr(self, "device_plan", None)
        self.runner = self.loaded = self._in_flight = None
        if plan is not None and plan.is_cuda:
            gc.collect()  # whatever a reference cycle still holds on the device
            torch.cuda.empty_cache()


def kv_groups_of(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> list[tuple]:
    """The model's KV groups as plan_kv_cache takes them: (spec, layer names, whether its kernel reads
    unwritten slots) for each set of layers with equal specs (C1); a quantized dtype the layers'
    backend cannot read on `device` is refused here."""
    kv_layers = model.kv_layers()
    groups: dict[tuple, list[str]] = {}
    for layer_name, spec in model.kv_cache_specs(config.block_size).items():
        spec = config.kv_spec(spec)
        if layer_name not in kv_layers:
            raise ValueError(f"layer {layer_name} has a KV spec but no module declaring reads_unwritten_slots")
        refuse_unreadable_kv_dtype(layer_name, kv_layers[layer_name], spec, device)
        groups.setdefault((spec, kv_layers[layer_name].reads_unwritten_slots), []).append(layer_name)
    return [(spec, tuple(layers), reads) for (spec, reads), layers in groups.items()]


def _decodes_only(out: SchedulerOutput) -> bool:
    """Whether every request of step `out` computed one token and its drafts (no prompt chunk)."""
    drafts_of = out.spec_token_ids
    return bool(out.num_scheduled_tokens) and all(
        n == 1 + len(drafts_of.get(rid, ())) for rid, n in out.num_scheduled_tokens.items())


def _companion(proposer_model: ProposerModel | None, proposer_kv: KVCacheManager | None) -> KVCacheManager | None:
    """The proposer's manager where it follows the target's allocations (kv/manager.py): a draft model's,
    unless it has sliding-window layers (whose blocks would be held back to the draft's lagging rows; such
    a draft allocates on its own, giving the least recent proposer's blocks back when full). An MTP head's
    rows sit one position past the target's: its cache is its own."""
    if proposer_model is None or proposer_model.proposer is not DraftModelProposer:
        return None
    if any(isinstance(g.spec, SlidingWindowSpec) for g in proposer_kv.config.groups):
        return None
    return proposer_kv
