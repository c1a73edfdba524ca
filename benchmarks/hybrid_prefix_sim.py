"""Hybrid prefix caching in the simulator: token hit rate vs. checkpoint memory, LRU vs. the
savings-weighted eviction policy, on the multi-turn trace of `benchmarks/multiturn.py`.

The real scheduler and KV manager run with the shadow runner (no model), so the whole grid takes
seconds. Each turn of a conversation arrives `think` steps after the previous one finished, so
turns of different conversations interleave as a server sees them.

    python -m benchmarks.hybrid_prefix_sim --json results/hybrid_prefix_sim.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
from dataclasses import dataclass

from blockserve.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroup, LinearStateSpec
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler import Request, SchedulerConfig
from blockserve.sim.drive import build


@dataclass(frozen=True)
class Trace:
    conversations: int = 16
    turns: int = 8
    system_tokens: int = 300
    user_tokens: tuple[int, int] = (30, 120)
    reply_tokens: tuple[int, int] = (40, 120)
    think_steps: tuple[int, int] = (0, 40)
    tenants: int = 1  # > 1: conversations spread over tenants with their own system prompts
    seed: int = 0


def run(trace: Trace, num_checkpoints: int | None, weight: float = 0.0, block_size: int = 16,
        chunk: int = 64) -> dict:
    """num_checkpoints None: a full-attention model (no state group)."""
    rng = random.Random(trace.seed)
    attention = KVCacheGroup(FullAttentionSpec(block_size, 2, 64), 4096, False, ("attn",))
    groups = (attention,)
    if num_checkpoints is not None:
        state = LinearStateSpec(shapes=((8, 3), (4, 16, 16)), dtypes=("float32",) * 2, chunk_size=chunk)
        groups += (KVCacheGroup(state, 33, True, ("state",), num_checkpoints=num_checkpoints),)
    config = KVCacheConfig(groups, checkpoint_savings_weight=weight)
    sched = SchedulerConfig(max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=512)
    scheduler, runner = build(config, sched, [False] * len(groups), vocab_size=32000)
    systems = [[rng.randrange(32000) for _ in range(trace.system_tokens)] for _ in range(trace.tenants)]
    history = [systems[c % trace.tenants] for c in range(trace.conversations)]
    turn = [0] * trace.conversations
    due = {c: rng.randint(*trace.think_steps) for c in range(trace.conversations)}  # conversation -> step
    per_turn = [[0, 0] for _ in range(trace.turns)]  # [prompt tokens, hit tokens]
    live: dict[str, tuple[int, Request]] = {}
    step = 0
    while due or scheduler.has_pending_work():
        for c in [c for c, at in due.items() if at <= step]:
            del due[c]
            prompt = history[c] + [rng.randrange(32000) for _ in range(rng.randint(*trace.user_tokens))]
            params = SamplingParams(max_tokens=rng.randint(*trace.reply_tokens), ignore_eos=True)
            request = Request(f"c{c}t{turn[c]}", prompt, params, arrival_time=float(step))
            scheduler.add_request(request)
            live[request.request_id] = (c, request)
        out = scheduler.schedule()
        outputs, _ = scheduler.update_from_output(out, runner.execute(out))
        for o in outputs:
            if not o.finished:
                continue
            c, request = live.pop(o.request_id)
            per_turn[turn[c]][0] += request.num_prompt_tokens
            per_turn[turn[c]][1] += o.num_cached_tokens
            history[c] = request.prompt_token_ids + request.output_token_ids
            turn[c] += 1
            if turn[c] < trace.turns:
                due[c] = step + 1 + rng.randint(*trace.think_steps)
        step += 1
    scheduler.assert_idle()
    queries = sum(q for q, _ in per_turn)
    hits = sum(h for _, h in per_turn)
    stats = scheduler.kv.prefix_cache_stats()
    return dict(num_checkpoints=num_checkpoints, weight=weight, hit_rate=hits / queries,
                hit_rate_from_turn_2=sum(h for _, h in per_turn[1:]) / sum(q for q, _ in per_turn[1:]),
                computed_prompt_tokens_per_turn=[q - h for q, h in per_turn], state_lost_tokens=stats.state_lost_tokens,
                checkpoint_restores=stats.checkpoint_restores, steps=step)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    weights = (0.0, 0.25, 0.5, 0.75, 1.0)
    traces = {"one system prompt": Trace(), "4 tenants, quick turns": Trace(tenants=4, think_steps=(0, 10), seed=1)}
    results = {"machine": platform.machine(), "traces": {}, "mean_hit_rate_by_weight": {}}
    means = dict.fromkeys(weights, 0.0)
    for name, trace in traces.items():
        full = run(trace, None)
        entry = results["traces"][name] = {"trace": trace.__dict__, "full_attention": full, "runs": []}
        print(f"{name}: full attention token hit rate {full['hit_rate']:.3f} "
              f"(from turn 2: {full['hit_rate_from_turn_2']:.3f}); hybrid, by checkpoints and savings weight w:")
        print(f"{'checkpoints':>11} " + " ".join(f"w={w:<4}" for w in weights))
        for n in (2, 4, 8, 16, 32, 64, 128):
            row = []
            for w in weights:
                r = run(trace, n, w)
                entry["runs"].append(r)
                means[w] += r["hit_rate"] / (7 * len(traces))
                row.append(f"{r['hit_rate']:.3f}")
            print(f"{n:>11} " + "  ".join(row))
    results["mean_hit_rate_by_weight"] = means
    print("mean token hit rate over both traces and all sizes: "
          + ", ".join(f"w={w}: {m:.3f}" for w, m in means.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
