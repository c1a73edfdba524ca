"""Text in, text out around the engine core: tokenising, detokenising, stop strings, n > 1.

A request with n > 1 fans out into n child requests. The first is admitted at once; the others
once its prompt is computed, so that (with prefix caching) they reuse its cached prompt blocks
instead of computing the prompt n times. A seeded request gives child i the seed `seed + i`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from blockserve.engine.config import EngineConfig
from blockserve.engine.core import EngineCore, RunnerFailed
from blockserve.engine.detokenizer import IncrementalDetokenizer
from blockserve.engine.kv_budget import CudaBudget
from blockserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from blockserve.engine.template_kwargs import template_kwargs
from blockserve.errors import EngineDead, InvalidRequest, RequestRejected
from blockserve.kv.block_pool import ResetResult
from blockserve.kv.config import KVCacheConfig
from blockserve.models.weight_memory import resident_weight_bytes
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler.output import RequestOutput as CoreOutput
from blockserve.scheduler.output import SchedulerStats
from blockserve.scheduler.request import Request
from blockserve.structured.compiler import GrammarCompiler, GrammarLimits
from blockserve.worker.cuda_graphs import Capture, graph_blockers
from blockserve.worker.model_runner import ModelRunner, RunnerTimings


class StepFailed(RuntimeError):
    """An engine step failed: its requests (`request_ids`, as given to add_request) were aborted.
    `broken` is None while the engine's state is intact (other requests go on, new ones may be
    added); otherwise it says what is broken, and the engine must not step again."""

    def __init__(self, request_ids: list[str], cause: BaseException | None, broken: str | None = None):
        what = f"{type(cause).__name__}: {cause}" if cause is not None else "unknown error"
        super().__init__(f"engine step failed ({what}); aborted {len(request_ids)} request(s): {request_ids[:8]}"
                         + (f"; the engine is broken: {broken}" if broken else ""))
        self.request_ids = request_ids
        self.broken = broken

    @property
    def engine_intact(self) -> bool:
        return self.broken is None


@dataclass
class _Child:
    parent: str
    index: int
    detokenizer: IncrementalDetokenizer | None  # None for a model without a tokenizer: no text


@dataclass
class _Parent:
    output: RequestOutput
    params: SamplingParams
    priority: int
    cache_salt: str | None
    waiting_children: list[int]  # admitted once the first child's prompt is computed


class LLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None):
        """The engine over `core` (default: one built from `config`, which a failure here stops
        again, tensor-parallel ranks included, before the error propagates)."""
        self.config = config
        self.core = core or EngineCore(config)
        try:
            loaded = self.core.loaded
            self.tokenizer = loaded.tokenizer  # None: token-id prompts only, no text
            self.vocab_size = loaded.hf_config.vocab_size
            eos = self.tokenizer.eos_token_id if self.tokenizer is not None else loaded.hf_config.eos_token_id
            self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
            # the model's other end-of-sequence ids (its generation config's list): stop tokens of every
            # request that does not ignore EOS, as vLLM adds them
            self.extra_eos_token_ids = tuple(t for t in loaded.eos_token_ids if t != self.eos_token_id)
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_id,
                                            GrammarLimits(json_bounds=config.json_bounds))
        except BaseException:
            if core is None:
                self.core.close()
            raise
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._broken: str | None = None  # set by a failed step that left the KV books unbalanced

    # -- requests in -----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (token ids are checked against the vocabulary); InvalidRequest
        for text on a model without a tokenizer."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: give prompts as lists of token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """The messages through the tokenizer's chat template, as token ids, `chat_template_kwargs`
        its variables (template_kwargs.py); InvalidRequest when the model has none, a variable is
        reserved or the template rejects the messages."""
        variables = template_kwargs(chat_template_kwargs)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, **variables)
        except Exception as e:  # the template's own checks (roles must alternate, ...) are the caller's to fix
            raise InvalidRequest(f"the chat template rejected the messages: {e}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens included); InvalidRequest for ids outside the
        vocabulary or a model without a tokenizer."""
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer, so token ids have no text")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}", param="tokens")
        return self.tokenizer.decode(list(token_ids))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a prompt. Raises InvalidRequest (a ValueError; RequestRejected and PromptTooLong
        included) naming what is wrong; a request that fails to be added leaves nothing behind."""
        self._check_not_broken()
        if request_id in self._parents:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        params = self.prepare_params(params or SamplingParams())
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        prompt_ids = self.tokenize(prompt)
        output = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, prompt_ids,
                               [CompletionOutput(i) for i in range(params.n)])
        self._parents[request_id] = _Parent(output, params, priority, cache_salt, list(range(1, params.n)))
        try:
            self._add_child(request_id, 0)
        except BaseException:
            del self._parents[request_id]  # _add_child adds nothing to the core unless it succeeds
            raise

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """`params` checked against this model (logit_bias and stop token ids in the vocabulary) with its
        structured_outputs grammar compiled (a no-op when it is already). InvalidRequest naming
        what is wrong. Thread-safe, so a server can compile off the engine thread first."""
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            if bad := [t for t in ids if t >= self.vocab_size]:
                raise InvalidRequest(f"{name} token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param=name)
        spec = params.structured_outputs
        if spec is None or spec.compiled is not None:
            return params
        compiled = self.grammars.compile(spec)
        return dataclasses.replace(params, structured_outputs=dataclasses.replace(spec, compiled=compiled))

    @staticmethod
    def _child_id(parent_id: str, n: int, index: int) -> str:
        return parent_id if n == 1 else f"{parent_id}#{index}"

    def _add_child(self, parent_id: str, index: int) -> None:
        parent = self._parents[parent_id]
        params = parent.params
        child_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index,
                                           prompt_logprobs=params.prompt_logprobs if index == 0 else None)
        if self.extra_eos_token_ids and not params.ignore_eos:
            child_params = dataclasses.replace(child_params, stop_token_ids=tuple(dict.fromkeys(
                (*params.stop_token_ids, *self.extra_eos_token_ids))))
        child_id = self._child_id(parent_id, params.n, index)
        request = Request(child_id, parent.output.prompt_token_ids, child_params, self.eos_token_id,
                          arrival_time=time.monotonic(), priority=parent.priority, cache_salt=parent.cache_salt)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, parent.output.prompt_token_ids, child_params)
        self.core.add_request(request)  # last: whatever fails before it leaves the core untouched
        self._children[child_id] = _Child(parent_id, index, detokenizer)

    def abort_request(self, request_ids) -> None:
        """Abort parents (all their samples); idempotent, unknown ids are ignored."""
        for parent_id in request_ids:
            parent = self._parents.pop(parent_id, None)
            if parent is None:
                continue
            child_ids = [self._child_id(parent_id, parent.params.n, i) for i in range(parent.params.n)]
            self.core.abort(child_ids)
            for child_id in child_ids:
                self._children.pop(child_id, None)

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the (cumulative) outputs of requests that advanced.

        If the model runner raises, the requests of that step are aborted (all samples of each)
        and StepFailed names them, the runner's exception chained; `engine_intact` says whether
        the KV books still balance (`check_integrity()`), i.e. whether stepping on is safe."""
        self._check_not_broken()
        try:
            core_outputs, _ = self.core.step()
        except RunnerFailed as e:
            raise self._step_failed(e) from e.__cause__
        touched: dict[str, RequestOutput] = {}
        ended: list[str] = []  # parents with a sample that finished this step
        children, parents = self._children, self._parents  # (this loop runs for every request of the step)
        for core_output in core_outputs:
            child = children.get(core_output.request_id)
            if child is None:
                continue
            parent = parents[child.parent]
            if self._apply(child, parent, core_output):
                ended.append(child.parent)
            touched[child.parent] = parent.output
            if child.index == 0 and parent.waiting_children:
                for index in parent.waiting_children:
                    self._add_child(child.parent, index)
                parent.waiting_children = []
        for parent_id in ended:
            output = touched[parent_id]
            if not output.finished and all(c.finished for c in output.outputs):
                output.finished = True
                del self._parents[parent_id]
        return list(touched.values())

    def _step_failed(self, failure: RunnerFailed) -> StepFailed:
        parent_ids = list(dict.fromkeys(self._children[c].parent for c in failure.request_ids if c in self._children))
        self.abort_request(parent_ids)
        try:
            self.core.check_kv_integrity()
        except AssertionError as e:
            self._broken = f"the KV cache's books no longer balance after a failed step: {e}"
            return StepFailed(parent_ids, failure.__cause__, self._broken)
        return StepFailed(parent_ids, failure.__cause__)

    def _check_not_broken(self) -> None:
        if self._broken is not None:
            raise EngineDead(f"{self._broken}; this engine cannot serve any more: restart it")

    def _apply(self, child: _Child, parent: _Parent, core_output: CoreOutput) -> bool:
        """Add a step's output to the sample's completion; True if the sample finished."""
        output, new_ids, detokenizer = parent.output, core_output.new_token_ids, child.detokenizer
        completion = output.outputs[child.index]
        if child.index == 0:
            output.num_cached_tokens = core_output.num_cached_tokens
            if core_output.prompt_logprobs is not None:  # the first sample computes them, for all
                prompt = output.prompt_token_ids
                output.prompt_logprobs = [None] + [
                    self._logprob_dict(token, lp) for token, lp in zip(prompt[1:], core_output.prompt_logprobs)]
        completion.token_ids.extend(new_ids)
        if detokenizer is not None:
            completion.text += detokenizer.push(new_ids)
        if core_output.new_logprobs and parent.params.logprobs is not None:
            completion.logprobs = (completion.logprobs or []) + [
                self._logprob_dict(token, lp) for token, lp in zip(new_ids, core_output.new_logprobs)
            ]
        finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
        if detokenizer is not None:
            if detokenizer.stop_string is not None:
                if finish_reason is None:
                    self.core.finish([core_output.request_id])
                finish_reason, stop_reason = "stop", detokenizer.stop_string
            elif finish_reason is not None:
                completion.text += detokenizer.finish()
        if finish_reason is None:
            return False
        completion.finish_reason, completion.stop_reason = finish_reason, stop_reason
        del self._children[core_output.request_id]
        return True

    def _logprob_dict(self, token: int, lp) -> dict[int, Logprob]:
        entries = {}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            entries[tid] = Logprob(value, rank, self._decode_one(tid))
        if token not in entries:
            entries[token] = Logprob(lp.logprob, None, self._decode_one(token))
        return entries

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or self.core.has_work()

    # -- the façade the server and the benchmarks use (never engine.core.*) ----------------------

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output (tokens) a request may have."""
        return self.core.max_model_len

    def stats(self) -> SchedulerStats:
        """Queue depths, KV usage per group, cumulative prefix-cache and preemption counters."""
        return self.core.scheduler.stats()

    @property
    def weights_resident_bytes(self) -> dict[str, int]:
        """The loaded model's parameter and buffer bytes per dtype name (models/weight_memory.py)."""
        return resident_weight_bytes(self.core.loaded.model)

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The KV cache groups as built: specs, layers, block counts and the derived zero flags (C1)."""
        return self.core.kv_config

    @property
    def device_kv_budget(self) -> CudaBudget | None:
        """On CUDA, how --gpu-memory-utilization was spent (engine/kv_budget.py); None on the CPU."""
        return self.core.kv_budget

    @property
    def cuda_graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes replayed as CUDA graphs (empty: every step runs eagerly)."""
        graphs = getattr(self.core.runner, "graphs", None)  # a tensor-parallel runner has none
        return () if graphs is None else tuple(sorted(graphs.graphs))

    def capture_decode_graphs(self, sizes, capture: Capture) -> None:
        """Capture the decode step at each batch size in `sizes` through `capture` (a stand-in for CUDA
        graph capture, for tests and benchmarks off a GPU; on CUDA the engine captures at start-up).
        Raises ValueError, saying why, when this model's decode cannot be captured."""
        runner = self.core.runner
        if not isinstance(runner, ModelRunner):
            raise ValueError("a tensor-parallel engine runs no CUDA graphs")
        if blockers := graph_blockers(runner.model):
            raise ValueError("this model's decode cannot be captured: " + "; ".join(blockers))
        runner.capture_decode_graphs(sizes, capture)

    def close(self) -> None:
        """Stop the engine: its tensor-parallel ranks, and its second prefix-cache tier's writer once the
        saves queued are written. Idempotent; the engine serves nothing after."""
        self.core.close()

    def reset_prefix_cache(self) -> ResetResult:
        """Drop every cached (unreferenced) block; refused (`ok` False, with the reason) while
        requests hold blocks."""
        return self.core.kv.reset_prefix_cache()

    @property
    def speculator(self):
        """The scheduler's Speculator (spec_decode/speculator.py: its proposer and step-cost rule), None
        without a speculative_config."""
        return self.core.scheduler.speculator

    def offload_writer_busy(self) -> bool:
        """Whether the second prefix-cache tier's writer has saves still to write (False without a tier)."""
        store = self.core.kv_offload
        return store is not None and not store.is_idle()

    def step_timings(self) -> RunnerTimings:
        """The model runner's cumulative time per phase (zero, prepare, forward, sample) and steps."""
        return self.core.runner.timings
