"""Drive the real scheduler and KV manager with a shadow runner through an arrival stream."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from blockserve.kv.config import KVCacheConfig
from blockserve.kv.manager import KVCacheManager
from blockserve.kv.tiers.store import TieredKVStore
from blockserve.scheduler.config import SchedulerConfig
from blockserve.scheduler.request import Request, RequestRejected
from blockserve.scheduler.scheduler import Scheduler
from blockserve.sim.shadow_proposer import ShadowProposer
from blockserve.sim.shadow_runner import ShadowRunner
from blockserve.spec_decode.config import SpeculativeConfig
from blockserve.spec_decode.speculator import Speculator
from blockserve.spec_decode.step_costs import FlatStepCosts


@dataclass(frozen=True)
class Arrival:
    step: int  # added just before this step's schedule()
    request: Request
    abort_at_step: int | None = None


@dataclass
class StreamResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_hits: int = 0
    state_restores: int = 0  # checkpoint copies into running slots
    state_captures: int = 0
    tier_hits: int = 0  # prompt tokens a second tier supplied
    tier_waits: int = 0  # admissions put off a step while their tier blocks were read
    draft_tokens: int = 0  # speculative decoding: drafts proposed, and rejected
    rejected_drafts: int = 0


def build(
    kv_config: KVCacheConfig, scheduler_config: SchedulerConfig, reads_unwritten_slots, vocab_size: int = 1000,
    offload: TieredKVStore | None = None,
    speculative: SpeculativeConfig | None = None,
) -> tuple[Scheduler, ShadowRunner]:
    """The real scheduler and KV manager (with `offload` as their second tier) and a shadow runner;
    with `speculative`, drafts from a ShadowProposer (partly right, partly wrong) up to its
    num_speculative_tokens."""
    # The shadow's steps take no time worth weighing drafts by: every draft is verified.
    speculator = None if speculative is None else Speculator(speculative, ShadowProposer(vocab_size), FlatStepCosts())
    scheduler = Scheduler(scheduler_config, KVCacheManager(kv_config, offload), speculator)
    salt_of = lambda request_id: scheduler.requests[request_id].cache_salt  # noqa: E731
    return scheduler, ShadowRunner(kv_config, reads_unwritten_slots, vocab_size, salt_of, offload)


def run_stream(
    scheduler: Scheduler,
    runner: ShadowRunner,
    arrivals: Iterable[Arrival],
    check: bool = True,
    max_steps: int = 100_000,
    after_schedule: Callable[[Scheduler], None] | None = None,
    keep_outputs: bool = True,
) -> StreamResult:
    """Run until every request finished and the last buffers were handed over.

    `arrivals` must come in step order; it may be a generator, so a long stream costs no memory.
    With `keep_outputs=False` the result holds counts only.

    With `check`, `check_integrity()` runs after every schedule and update (C3). Raises
    RuntimeError if the stream does not finish within `max_steps` (a livelock, C5).
    """
    result = StreamResult()
    upcoming = iter(arrivals)
    arrival = next(upcoming, None)
    aborts: dict[int, list[str]] = {}
    step = 0
    while arrival is not None or scheduler.has_pending_work():
        if step >= max_steps:
            raise RuntimeError(f"stream did not finish in {max_steps} steps: {len(scheduler.requests)} requests left")
        while arrival is not None and arrival.step <= step:
            arrival, current = next(upcoming, None), arrival
            try:
                scheduler.add_request(current.request)
            except RequestRejected as e:
                result.rejected[current.request.request_id] = str(e)
                continue
            if current.abort_at_step is not None:
                aborts.setdefault(max(current.abort_at_step, step), []).append(current.request.request_id)
        for rid in aborts.pop(step, ()):
            if scheduler.abort([rid]):
                result.finish_reasons[rid] = "abort"
        out = scheduler.schedule()
        if check:
            scheduler.kv.check_integrity()
        if after_schedule:
            after_schedule(scheduler)
        runner_out = runner.execute(out)
        outputs, stats = scheduler.update_from_output(out, runner_out)
        if check:
            scheduler.kv.check_integrity()
        for o in outputs if keep_outputs else ():
            result.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                result.finish_reasons[o.request_id] = o.finish_reason
        step += 1
    result.num_steps = step
    result.num_preemptions = scheduler.num_preemptions
    result.prefix_hits = scheduler.kv.prefix_cache_stats().hits
    result.state_restores = runner.num_restores
    result.state_captures = runner.num_captures
    result.tier_hits = scheduler.kv.prefix_cache_stats().tier_hits
    result.tier_waits = 0 if scheduler.kv.external is None else scheduler.kv.external.num_load_waits
    if scheduler.speculator is not None:
        result.draft_tokens = scheduler.speculator.stats().num_draft_tokens
        result.rejected_drafts = runner.num_rejected
    return result
