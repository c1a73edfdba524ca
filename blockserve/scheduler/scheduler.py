"""Continuous batching: which requests compute how many tokens in the next step.

Each step fills a token budget: running requests first (decodes and unfinished prompts, in
policy order), then waiting ones (FCFS, or priority with FCFS tie-break), each taking a prefix
hit on admission. Long prompts are chunked and batched with decodes. When blocks run out the
lowest-priority, latest-arrived running request that is not yet scheduled this step is preempted:
it frees everything and returns to the front of the waiting queue, to be recomputed later.

    schedule() ──► SchedulerOutput ──► worker ──► update_from_output() ──► RequestOutputs

With async scheduling (engine/core.py) step N + 1 is scheduled before step N's tokens are back: a
request N samples for holds a placeholder (`num_output_placeholders`), its next input id is -1 in
`scheduled_token_ids` (the worker takes it from N's samples on the device), and a request N ends by
length is not scheduled again. Whatever else ends it at N (a stop token) leaves one wasted row in
N + 1, whose token is dropped.

With speculative decoding (a `Speculator`, spec_decode/) a decoding request may carry draft tokens:
their slots are allocated with its input token's (`allocate_slots`, counted in the token budget) and
its computed count covers them while the step runs; `update_from_output` then takes back the
rejected drafts' count (their KV is never reported computed nor cached, C4) and frees the blocks
that held only them. If the drafts' slots do not fit, the request runs without drafts: speculation
never preempts anyone.
"""

from __future__ import annotations

import bisect
from array import array

from blockserve.errors import PromptTooLong, RequestRejected
from blockserve.kv.manager import ComputedBlocks, KVCacheManager
from blockserve.scheduler.config import SchedulerConfig
from blockserve.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from blockserve.scheduler.request import Request, RequestStatus
from blockserve.scheduler.request_queue import FCFSQueue, PriorityQueue
from blockserve.spec_decode.proposer import DraftSampling
from blockserve.spec_decode.speculator import Speculator


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, speculator: Speculator | None = None):
        self.config = config
        self.kv = kv
        self.speculator = speculator
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = PriorityQueue() if config.policy == "priority" else FCFSQueue()
        self.running: list[Request] = []  # in policy order: the last one is the next victim
        self._num_added = 0
        # C2: the scheduler's own per-step buffer, drained by every schedule().
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self._no_hit = ComputedBlocks(0, tuple(() for _ in kv.config.groups))
        self._last_output: SchedulerOutput | None = None  # the latest step scheduled

    # -- requests in -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or reject it at once (C5) with a RequestRejected saying why
        (PromptTooLong when it is over max_model_len)."""
        try:
            self._validate(request)
        except RequestRejected as e:
            request.status = RequestStatus.FINISHED_REJECTED
            request.error = str(e)
            raise
        request.block_hashes = self.kv.new_block_hashes(request.cache_salt)
        self._num_added += 1
        key = (request.arrival_time, self._num_added)
        request.order_key = (request.priority, *key) if self.config.policy == "priority" else key
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _validate(self, request: Request) -> None:
        rid, n, limit = request.request_id, request.num_prompt_tokens, self.config.max_model_len
        if rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use")
        if n == 0:
            raise RequestRejected(f"request {rid!r} has an empty prompt; give at least one token")
        try:
            array("I", request.prompt_token_ids)  # in C: fast enough for every request
        except (OverflowError, TypeError):
            bad = next(t for t in request.prompt_token_ids if not isinstance(t, int) or not 0 <= t < 2**32)
            raise RequestRejected(f"request {rid!r}: prompt token id {bad!r} is not an integer in [0, 2**32)") from None
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = limit - n
            if max_tokens < 1:
                raise PromptTooLong(
                    f"request {rid!r}: the prompt has {n} tokens, which leaves no room to generate within "
                    f"the model's maximum length of {limit}"
                )
        elif n + max_tokens > limit:
            raise PromptTooLong(
                f"request {rid!r}: the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} "
                f"tokens, over the model's maximum length of {limit}; shorten the prompt or lower max_tokens"
            )
        # The last sampled token is never fed back, so its KV is never written.
        reason = self.kv.never_fits(n + max_tokens - 1, self.config.chunk_cap)
        if reason:
            raise RequestRejected(f"request {rid!r}: {reason}")
        request.max_output_tokens = max_tokens

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        cap = self.config.chunk_cap
        scheduled: list[tuple[Request, int]] = []
        cached: list[CachedRequestData] = []
        new: list[NewRequestData] = []
        preempted: set[str] = set()
        drafts_of: dict[str, list[int]] = {}
        speculator = self.speculator
        running, allocate_slots = self.running, self.kv.allocate_slots
        if speculator is not None:
            speculator.begin_step()
            if speculator.batches:  # drafts for every request that may verify some, in one batch
                speculator.prepare_step([(request.request_id, request.token_ids, room,
                                          DraftSampling(request.sampling_params, request.num_prompt_tokens,
                                                        request.eos_token_id, request.cache_salt))
                                         for request in running
                                         if _may_draft(request) and (room := _draft_room(request, budget, cap)) > 0],
                                        len(running), self._reserve_drafts if self.kv.companion is not None else None)

        # This loop and the one that fills the token ids run for every running request every step.
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            pending = request.num_output_placeholders
            if pending and len(request.output_token_ids) + pending >= request.max_output_tokens:
                i += 1  # its token in flight is its last (max_tokens; max_model_len is never later: _validate)
                continue
            n = min(len(request.token_ids) + pending - request.num_computed_tokens, budget, cap)
            if n <= 0:
                i += 1
                continue
            block_ids = None
            if speculator is not None and _may_draft(request):
                room = _draft_room(request, budget, cap)
                structured = request.sampling_params.structured_outputs  # drafts its grammar refuses are cut
                grammar = structured.compiled if structured is not None else None
                drafts = speculator.propose(request.request_id, request.token_ids, room, len(running), grammar,
                                            request.output_token_ids) if room > 0 else ()
                if drafts and (block_ids := allocate_slots(request, 1 + len(drafts))) is not None:
                    drafts_of[request.request_id] = drafts
                    n = 1 + len(drafts)
            while block_ids is None and (block_ids := allocate_slots(request, n)) is None:
                victim = running[-1]  # never one scheduled this step: those sit before index i
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if block_ids is None:
                break  # it preempted itself, so nothing after it is left either
            cached.append(CachedRequestData(request.request_id, block_ids, request.num_computed_tokens))
            scheduled.append((request, n))
            budget -= n
            i += 1

        while (
            not preempted  # blocks are short: admit nobody this step
            and budget > 0
            and self.waiting
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.num_output_placeholders:
                break  # preempted with a token in flight: re-admitted once it is back
            no_hit = _wants_prompt_logprobs(request)
            hit = self._no_hit if no_hit else self.kv.get_computed_blocks(request)
            external = 0 if no_hit else self.kv.num_external_tokens(request, hit)  # a second tier's (kv/tiers/)
            if external and scheduled and not self.kv.external_loads_ready(request, hit, external):
                break  # its blocks are read off this thread while the step runs the others; admitted once read
            n = len(request.token_ids) - hit.num_tokens - external
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget, cap)
            loaded = 0
            if external:
                # Loads failing their check leave their tokens to compute: n of them this step, the rest after.
                loaded = self.kv.allocate_external_computed_blocks(request, n, hit, external)
                if loaded is None:
                    break
            elif self.kv.allocate_slots(request, n, hit) is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_tokens + loaded
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens + loaded
                request.state_lost_tokens = max(0, hit.state_lost_tokens - loaded)
            bisect.insort(self.running, request, key=lambda r: r.order_key)
            new.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    list(request.output_token_ids),
                    request.sampling_params,
                    self.kv.block_ids(request.request_id),
                    request.num_computed_tokens,
                    request.eos_token_id,
                )
            )
            scheduled.append((request, n))
            budget -= n

        num_scheduled, token_ids = {}, {}
        plan_captures = self.kv.plan_captures if self.kv.checkpointing else None
        for request, n in scheduled:
            rid, start = request.request_id, request.num_computed_tokens
            end = start + n
            num_scheduled[rid] = n
            known = len(request.token_ids)
            drafts = drafts_of.get(rid)
            if drafts is not None:
                token_ids[rid] = request.token_ids[start:] + drafts
                end -= len(drafts)  # (request.num_computed_tokens covers them too while the step runs)
            elif end <= known:
                token_ids[rid] = request.token_ids[start:end]
            else:  # the input is a token in flight
                token_ids[rid] = request.token_ids[start:known] + [-1] * (end - known)
            if plan_captures is not None:
                plan_captures(request, start, n)
            if end == known + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
            request.num_computed_tokens = start + n  # KV written by the forward pass of this step

        pending = self.kv.take_pending()
        finished, self._finished_ids = self._finished_ids, set()
        self._last_output = SchedulerOutput(
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=num_scheduled,
            scheduled_token_ids=token_ids,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_zero=pending.blocks_to_zero,
            blocks_to_poison=pending.blocks_to_poison,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            state_copies=pending.state_copies,
            state_captures=pending.state_captures,
            blocks_to_save=pending.blocks_to_save,
            blocks_to_load=pending.blocks_to_load,
            spec_token_ids=drafts_of,
        )
        return self._last_output

    def _reserve_drafts(self, request_id: str, num_drafts: int) -> bool:
        """Cover a request's token and `num_drafts` drafts in the draft model's groups (its companion
        manager) before the draft writes them; False if they do not fit (no drafts this step)."""
        return self.kv.reserve_companion(self.requests[request_id], 1 + num_drafts)

    def _preempt(self, request: Request) -> None:
        self.running.pop()
        self.kv.free(request.request_id)
        if self.speculator is not None:
            self.speculator.preempted(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(request)

    # -- results in ------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> tuple[list[RequestOutput], SchedulerStats]:
        """Append sampled tokens, apply stop conditions, free finished requests, and register
        the blocks this step filled in the prefix cache (only now is their KV written: C4).

        With async scheduling the next step is scheduled already: a request may have been preempted
        since (its token still counts), and its computed count may include the next step's tokens."""
        outputs = []
        any_finished = False
        # This loop runs for every request of the step: what it looks up per request is bound once here.
        requests, running = self.requests, RequestStatus.RUNNING
        cache_blocks = self.kv.cache_blocks if self.kv.enable_caching else None
        # Each request's computed count before this step, when a later step has advanced it since (only
        # caching reads it).
        ahead = scheduler_output is not self._last_output and cache_blocks is not None
        starts = _starts(scheduler_output) if ahead else None
        sampled_token_ids = runner_output.sampled_token_ids
        all_logprobs, all_prompt_logprobs = runner_output.logprobs or None, runner_output.prompt_logprobs or None
        drafts_of = scheduler_output.spec_token_ids
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None:
                continue  # finished or aborted since it was scheduled
            drafts = drafts_of.get(rid) if drafts_of else None
            if drafts is not None:
                if self._verified(request, drafts, sampled_token_ids.get(rid), all_logprobs, outputs):
                    any_finished = True
                continue
            if request.status is running:
                if cache_blocks is not None:
                    cache_blocks(request, request.num_computed_tokens if starts is None else starts[rid] + num_scheduled)
            elif request.status is not RequestStatus.PREEMPTED:
                continue
            sampled = sampled_token_ids.get(rid)
            if not sampled:
                continue  # a prompt chunk that does not end the prompt
            request.num_output_placeholders -= len(sampled)
            status = None
            accepted = 0
            for token in sampled:
                request.output_token_ids.append(token)
                request.token_ids.append(token)
                accepted += 1
                if status := self._stop_status(request, token):
                    break
            logprobs = all_logprobs and all_logprobs.get(rid)
            outputs.append(
                RequestOutput(
                    rid,
                    sampled if accepted == len(sampled) else sampled[:accepted],
                    status and status.value,
                    request.stop_reason,
                    request.num_cached_tokens,  # >= 0: it was admitted
                    logprobs[:accepted] if logprobs is not None else None,
                    prompt_logprobs=all_prompt_logprobs and all_prompt_logprobs.get(rid),
                )
            )
            if status:
                if request.status is RequestStatus.PREEMPTED:
                    self.waiting.remove(request)
                self._finish(request, status)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs, self.stats(scheduler_output.total_num_scheduled_tokens)

    def _verified(self, request: Request, drafts: list[int], sampled: list[int] | None, all_logprobs,
                  outputs: list[RequestOutput]) -> bool:
        """Apply a speculative step's result to `request`: the target accepted the first len(sampled) - 1
        drafts. Rejected drafts' slots leave the computed count and the blocks holding only them are
        freed, before the accepted tokens are appended and cached (C4). Returns whether it finished."""
        if not sampled or len(sampled) > len(drafts) + 1:
            raise RuntimeError(f"request {request.request_id}: {len(drafts)} drafts, but the worker returned "
                               f"{len(sampled or ())} tokens (expected 1 to {len(drafts) + 1})")
        accepted = len(sampled) - 1
        self.speculator.record(request.request_id, len(drafts), accepted)
        request.num_computed_tokens -= len(drafts) - accepted
        request.num_output_placeholders -= 1
        status = None
        emitted = 0
        for token in sampled:
            request.output_token_ids.append(token)
            request.token_ids.append(token)
            emitted += 1
            if status := self._stop_status(request, token):
                break
        logprobs = all_logprobs and all_logprobs.get(request.request_id)
        outputs.append(RequestOutput(request.request_id, sampled[:emitted], status and status.value,
                                     request.stop_reason, request.num_cached_tokens,
                                     logprobs[:emitted] if logprobs is not None else None))
        if status:
            if self.kv.enable_caching:  # as a plain decode's last step does: its accepted captures count
                self.kv.cache_blocks(request, min(request.num_computed_tokens, len(request.token_ids)))
            self._finish(request, status)
            return True
        self.kv.trim_slots(request, len(request.token_ids))
        if self.kv.enable_caching:
            self.kv.cache_blocks(request, request.num_computed_tokens)
        return False

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        """Runs for every sampled token, so it reads plain attributes only."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_output_tokens:  # prompt + max_output_tokens <= max_model_len (_validate)
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[str]:
        """End requests from outside (a stop string matched, a client went away). Unknown or
        already finished ids are ignored, so this is idempotent. Returns the ids it ended."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            ended.append(rid)
        return ended

    def abort(self, request_ids) -> list[str]:
        """Abort requests at any time; idempotent."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # -- state -----------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        """Requests to run, or buffers the next `schedule()` must still hand to the worker."""
        return bool(self.requests) or bool(self._finished_ids) or not self.kv.pending_is_empty()

    def stats(self, num_scheduled_tokens: int = 0) -> SchedulerStats:
        prefix = self.kv.prefix_cache_stats()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            prefix_cache_state_lost_tokens=prefix.state_lost_tokens,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens=num_scheduled_tokens,
            prefix_cache_tier_hits=prefix.tier_hits,
            kv_offload=self.kv.offload_stats(),
            speculation=self.speculator.stats() if self.speculator is not None else None,
            proposer_kv_usage=None if (proposer_kv := self._proposer_kv()) is None else proposer_kv.usage(),
        )

    def _proposer_kv(self):
        """The KVCacheManager of a draft model or MTP head, if the speculator's proposer has one."""
        return getattr(self.speculator.proposer, "kv", None) if self.speculator is not None else None

    def assert_idle(self) -> None:
        """C2: once every request finished and a last step ran, nothing is held or pending."""
        assert not self.requests and not self.running and not self.waiting, "requests remain"
        assert not self._finished_ids, "finished ids were never handed to the worker"
        assert self.kv.pending_is_empty(), "KV zero or poison orders were never drained"
        assert self.speculator is None or not self.speculator.num_requests, "speculation state outlives its requests"
        self.kv.assert_idle()
        proposer_kv = self._proposer_kv()
        if proposer_kv is not None:  # a draft model's or an MTP head's own cache
            assert proposer_kv.pending_is_empty(), "the proposer's KV zero or poison orders were never drained"
            proposer_kv.assert_idle()


def _starts(out: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's computed count when `out` was scheduled."""
    starts = {c.request_id: c.num_computed_tokens for c in out.cached_requests}
    starts.update((n.request_id, n.num_computed_tokens) for n in out.new_requests)
    return starts


def _wants_prompt_logprobs(request: Request) -> bool:
    """Prompt logprobs need the logits of every prompt token, which tokens served from the prefix
    cache lack (worker/prompt_logprobs.py): such a request is admitted without a hit until it sampled."""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids


def _draft_room(request: Request, budget: int, cap: int) -> int:
    """The most drafts a decoding request may verify this step: past its one token, within the step's
    token budget, the chunk cap and its max_tokens."""
    return min(budget - 1, cap - 1, request.max_output_tokens - len(request.output_token_ids) - 1)


def _may_draft(request: Request) -> bool:
    """Whether a running request's next step may verify drafts: it decodes (one token to compute,
    none in flight)."""
    return not request.num_output_placeholders and len(request.token_ids) - request.num_computed_tokens == 1
