"""The second prefix-cache tier on a multi-turn agent trace whose histories outgrow the device pool.

C conversations, each a distinct document then turns of (message, reply), served one request at a
time in round-robin, as an agent switching between tasks: by the time a conversation comes back,
the others have pushed its history out of a device KV budget that holds about 1/8 of all histories.
On the bundled model (or a tiny random hybrid with `--model hybrid`), per run: prompt tokens computed,
token hit rate, TTFT p50/p90 over turns 2+:

  tier off                device pool only
  unbounded device        a device pool holding every history (the hit-rate ceiling)
  disk tier               the small device pool and --kv-offload-dir

then one more turn per conversation: on the warm unbounded engine that ran the trace, and right after
a restart, cold (a new engine, no tier) and disk-warm (a new engine on the disk tier's directory); and decode ITL
of a batch whose prompts the writer is saving, tier off vs on, alternating over --itl-rounds rounds: per
round each one's p50 and their ratio, the ratio over the gaps of steps that ended with the writer still
busy (against tier off's same gaps), and the ratio of the step thread's CPU time per decode step (more
CPU time: the step computed slower; more wall time alone: it waited); the medians of those ratios over
the rounds, with the other processes' CPU share per run. Every run is greedy: the answers of all runs
must be equal (checked).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.kv_offload --json results/kv_offload.json
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.kv_offload --model hybrid --json results/kv_offload_hybrid.json
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.kv_offload --itl-only --num-threads 1 --json results/kv_offload_itl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time

from benchmarks.cpu_share import CpuShare
from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.bench.common import environment, percentile, print_environment, write_json
from benchmarks.multiturn import build_models
from blockserve.models.loader import load_model

BLOCK = 16


def make_trace(conversations: int, document: int, message: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    histories = [[rng.randrange(100, vocab) for _ in range(document)] for _ in range(conversations)]

    def messages():
        return [[rng.randrange(100, vocab) for _ in range(message)] for _ in range(conversations)]

    return histories, messages


def attention_tokens(loaded, kv_bytes: int, **engine) -> int:
    """The tokens an engine with `kv_bytes` of KV cache holds in its attention groups."""
    with LLM(loaded, kv_cache_memory=kv_bytes, **engine) as llm:
        groups = llm.engine.kv_cache_config.groups
    return min((g.num_blocks - 1) * g.spec.block_size for g in groups if not g.is_state)


def kv_bytes_for(loaded, tokens: int, **engine) -> int:
    """The KV cache size whose attention groups hold about `tokens` tokens (state slots and checkpoints,
    for a hybrid, on top): two probes, then the line through them."""
    low, high = 64 * 2**20, 128 * 2**20
    at_low, at_high = attention_tokens(loaded, low, **engine), attention_tokens(loaded, high, **engine)
    return int(low + (tokens - at_low) * (high - low) / (at_high - at_low))


def serve_one(llm: LLM, prompt: list[int], params: SamplingParams, rid: str):
    """(TTFT s, output tokens, cached tokens) of `prompt` served alone."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first = None
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter()
            if output.finished:
                final = output
    return first - start, final.outputs[0].token_ids, final.num_cached_tokens


def run_turns(llm: LLM, histories, messages, turns: int, reply: int, tag: str) -> dict:
    """Serve `turns` rounds over the conversations (extending `histories` in place)."""
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    per_turn = []
    answers = []
    for turn in range(turns):
        ttfts, prompt_tokens, cached = [], 0, 0
        for c, new in enumerate(messages()):
            prompt = histories[c] + new
            ttft, tokens, hit = serve_one(llm, prompt, params, f"{tag}-{turn}-{c}")
            ttfts.append(ttft)
            prompt_tokens += len(prompt)
            cached += hit
            answers.append(tokens)
            histories[c] = prompt + tokens
        per_turn.append({"ttft": ttfts, "prompt_tokens": prompt_tokens, "cached_tokens": cached})
    return {"per_turn": per_turn, "answers": answers}


def summary(per_turn: list[dict]) -> dict:
    later = per_turn[1:] or per_turn
    ttfts = [t for turn in later for t in turn["ttft"]]
    prompt = sum(t["prompt_tokens"] for t in per_turn)
    cached = sum(t["cached_tokens"] for t in per_turn)
    return {"prompt_tokens": prompt, "computed_tokens": prompt - cached, "token_hit_rate": cached / prompt,
            "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p90_ms": percentile(ttfts, 90) * 1e3}


def decode_itl(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list[float], list[bool], list[float]]:
    """Seconds between successive tokens of each request of one batch (its decode steps), in a fixed
    order (the same for every engine: greedy, one batch), whether the tier's writer had saves unwritten
    at the step's end, and the CPU seconds the step's thread spent in each decode step (what the step
    computed, without the time it waited for a CPU or a lock)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"itl-{i}", prompt, params)
    last, gaps, writing, step_cpu = {}, [], [], []
    while engine.has_unfinished_requests():
        cpu = time.thread_time()
        outputs = engine.step()
        now = time.perf_counter()
        cpu = time.thread_time() - cpu
        busy = engine.offload_writer_busy()
        decoded = False
        for output in sorted(outputs, key=lambda o: o.request_id):
            if output.outputs[0].token_ids:
                if output.request_id in last:
                    gaps.append(now - last[output.request_id])
                    writing.append(busy)
                    decoded = True
                last[output.request_id] = now
        if decoded:
            step_cpu.append(cpu)
    return gaps, writing, step_cpu


OFF, ON = "tier off", "disk tier, writer saving the prompts"


def measure_itl(args, loaded, engine: dict) -> dict:
    """Decode ITL of a batch of fresh prompts, tier off and with the writer saving them (a new directory
    each time), in rounds that run both (each order in every other round) so that both see the same load
    on a shared machine: per round each one's p50, and their ratio; the median of those ratios, the same
    over the gaps of steps that ended with the writer still busy (against tier off's same gaps), and of
    the ratios of the step thread's CPU time per decode step."""
    vocab = loaded.hf_config.vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.document)] for _ in range(args.itl_batch)]
    rounds = []
    for round_index in range(args.itl_rounds):
        measured = {}
        for name in (OFF, ON) if round_index % 2 == 0 else (ON, OFF):  # either order as often: no bias
            with tempfile.TemporaryDirectory() as directory:
                extra = {"kv_offload_dir": directory} if name == ON else {}
                with LLM(loaded, **engine, **extra) as llm:
                    share = CpuShare()
                    with share:
                        gaps, writing, step_cpu = decode_itl(llm, prompts, 64)
                measured[name] = {"gaps": gaps, "writing": writing, "step_cpu": step_cpu, "others_cpu_share": share.others}
        off, on = measured[OFF]["gaps"], measured[ON]["gaps"]
        busy = [i for i, w in enumerate(measured[ON]["writing"]) if w and i < len(off)]
        result = {name: {"itl_p50_ms": percentile(m["gaps"], 50) * 1e3, "itl_p90_ms": percentile(m["gaps"], 90) * 1e3,
                         "step_cpu_p50_ms": percentile(m["step_cpu"], 50) * 1e3,
                         "others_cpu_share": m["others_cpu_share"]} for name, m in measured.items()}
        result["p50_ratio"] = percentile(on, 50) / percentile(off, 50)
        result["step_cpu_p50_ratio"] = result[ON]["step_cpu_p50_ms"] / result[OFF]["step_cpu_p50_ms"]
        result["gaps"], result["gaps_writer_busy"] = len(on), len(busy)
        if busy:
            result["p50_ratio_writer_busy"] = (percentile([on[i] for i in busy], 50)
                                               / percentile([off[i] for i in busy], 50))
        rounds.append(result)
        print(f"round {len(rounds)}: ITL p50 off {result[OFF]['itl_p50_ms']:.1f} ms, on {result[ON]['itl_p50_ms']:.1f} "
              f"ms ({result['p50_ratio']:.3f}x); writer busy over {len(busy)} of {len(on)} gaps"
              + (f" ({result['p50_ratio_writer_busy']:.3f}x there)" if busy else "")
              + f"; step CPU p50 {result['step_cpu_p50_ratio']:.3f}x"
              + f"; others' CPU share {_share(result[OFF]['others_cpu_share'])} / {_share(result[ON]['others_cpu_share'])}",
              flush=True)
    busy_ratios = [r["p50_ratio_writer_busy"] for r in rounds if "p50_ratio_writer_busy" in r]
    summary = {
        "rounds": len(rounds),
        "p50_ratio_median": percentile([r["p50_ratio"] for r in rounds], 50),
        "p50_ratio_range": [min(r["p50_ratio"] for r in rounds), max(r["p50_ratio"] for r in rounds)],
        "step_cpu_p50_ratio_median": percentile([r["step_cpu_p50_ratio"] for r in rounds], 50),
        "p50_ratio_writer_busy_median": percentile(busy_ratios, 50) if busy_ratios else None,
        "gaps_writer_busy_share": sum(r["gaps_writer_busy"] for r in rounds) / sum(r["gaps"] for r in rounds),
    }
    for name in (OFF, ON):
        summary[name] = {key: percentile([r[name][key] for r in rounds], 50)
                         for key in ("itl_p50_ms", "itl_p90_ms", "step_cpu_p50_ms")}
        shares = [r[name]["others_cpu_share"] for r in rounds]
        summary[name]["others_cpu_share"] = None if None in shares else [min(shares), max(shares)]
    return {"summary": summary, "per_round": rounds}


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def print_itl(itl: dict) -> None:
    s = itl["summary"]
    for name in (OFF, ON):
        shares = s[name]["others_cpu_share"]
        others = "n/a" if shares is None else f"{shares[0]:.0%}-{shares[1]:.0%}"
        print(f"decode ITL, {name}: median over {s['rounds']} rounds of p50 {s[name]['itl_p50_ms']:.1f} ms, of p90 "
              f"{s[name]['itl_p90_ms']:.1f} ms (others' CPU share {others})")
    busy = s["p50_ratio_writer_busy_median"]
    print(f"decode ITL p50, writer saving / tier off: median of the rounds' ratios {s['p50_ratio_median']:.3f}x (rounds "
          f"{s['p50_ratio_range'][0]:.3f}x-{s['p50_ratio_range'][1]:.3f}x); over the gaps the writer was busy "
          f"({s['gaps_writer_busy_share']:.0%} of them): " + ("n/a" if busy is None else f"{busy:.3f}x")
          + f"; the step's CPU time per decode step: {s['step_cpu_p50_ratio_median']:.3f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--document", type=int, default=512, help="tokens of each conversation's first message")
    parser.add_argument("--message", type=int, default=48, help="tokens of each later message")
    parser.add_argument("--reply", type=int, default=16, help="tokens of each reply")
    parser.add_argument("--device-ratio", type=float, default=8.0,
                        help="all final histories / the device KV budget")
    parser.add_argument("--itl-batch", type=int, default=4)
    parser.add_argument("--itl-rounds", type=int, default=8, help="alternating rounds of the ITL runs, off and on")
    parser.add_argument("--itl-only", action="store_true", help="measure decode ITL only (no trace)")
    parser.add_argument("--model", choices=("bundled", "hybrid"), default="bundled",
                        help="bundled: SmolLM2-135M; hybrid: a tiny random Qwen3-Next (benchmarks.multiturn's), whose "
                             "state checkpoints go through the tier too")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    env = environment()
    print_environment(env)

    with tempfile.TemporaryDirectory() as root:
        if args.model == "hybrid":
            loaded = load_model(build_models(root)["hybrid (Qwen3-Next shape)"], BACKENDS["exact"])
        else:
            loaded = load_model(None, BACKENDS["exact"])
        return measure(args, env, loaded)


def measure(args, env: dict, loaded) -> int:
    vocab = loaded.hf_config.vocab_size
    final_tokens = args.conversations * (args.document + (args.turns + 1) * (args.message + args.reply))
    device_tokens = -(-int(final_tokens / args.device_ratio) // BLOCK) * BLOCK
    longest = args.document + (args.turns + 1) * (args.message + args.reply)
    max_model_len = -(-longest // BLOCK) * BLOCK
    device_tokens = max(device_tokens, max_model_len + BLOCK)
    engine = dict(max_model_len=max_model_len, max_num_seqs=4, num_threads=args.num_threads)
    small = dict(kv_cache_memory=kv_bytes_for(loaded, device_tokens, **engine), **engine)
    device_tokens = attention_tokens(loaded, small["kv_cache_memory"], **engine)
    print(f"{args.model} model; trace: {args.conversations} conversations x {args.turns} turns, final histories "
          f"{final_tokens} tokens; device KV budget {device_tokens} attention tokens "
          f"({final_tokens / device_tokens:.1f}x smaller, {small['kv_cache_memory'] / 2**20:.1f} MiB)")
    results = {"environment": env, "args": vars(args), "device_tokens": device_tokens, "final_history_tokens":
               final_tokens, "runs": {}}

    def trace(name: str, llm: LLM, share: CpuShare) -> dict:
        histories, messages = make_trace(args.conversations, args.document, args.message, vocab)
        with share:
            run = run_turns(llm, histories, messages, args.turns, args.reply, name)
        run["summary"] = summary(run["per_turn"])
        run["summary"]["others_cpu_share"] = share.others
        results["runs"][name] = {k: v for k, v in run.items() if k != "answers"}
        return run, histories, messages

    def next_turn(name: str, llm: LLM, histories, messages) -> dict:
        share = CpuShare()
        with share:
            run = run_turns(llm, [list(h) for h in histories], messages, 1, args.reply, name)
        run["summary"] = summary(run["per_turn"])
        run["summary"]["others_cpu_share"] = share.others
        results["runs"][name] = {k: v for k, v in run.items() if k != "answers"}
        return run

    if args.itl_only:
        results["decode_itl"] = itl = measure_itl(args, loaded, small)
        print_itl(itl)
        write_json(args.json, results)
        return 0
    after = make_trace(args.conversations, 0, args.message, vocab, seed=2)[1]()  # the next turn's, for every engine
    with tempfile.TemporaryDirectory() as directory:
        with LLM(loaded, **small) as llm:
            off, *_ = trace("tier off", llm, CpuShare())
        with LLM(loaded, **engine) as llm:
            unbounded, histories, _ = trace("unbounded device", llm, CpuShare())
            warm = next_turn("next turn: warm engine (unbounded device)", llm, histories, lambda: after)
        with LLM(loaded, kv_offload_dir=directory, **small) as llm:
            disk, *_ = trace("disk tier", llm, CpuShare())
            tier_stats = llm.engine.stats().kv_offload
        with LLM(loaded, kv_offload_dir=directory, **small) as llm:
            restarted = next_turn("next turn: restarted, disk-warm", llm, histories, lambda: after)
        with LLM(loaded, **small) as llm:
            cold = next_turn("next turn: restarted, cold", llm, histories, lambda: after)
        for name, run in (("unbounded device", unbounded), ("disk tier", disk)):
            assert run["answers"] == off["answers"], f"{name} answered differently from tier off"
        assert restarted["answers"] == cold["answers"] == warm["answers"], "the restart changed an answer"
        results["disk_tier_stats"] = dataclasses.asdict(tier_stats)

    results["decode_itl"] = itl = measure_itl(args, loaded, small)

    print(f"\n{'run':44} {'prompt tok':>10} {'computed':>9} {'hit rate':>8} {'TTFT p50 ms':>12} {'p90 ms':>8} "
          f"{'others CPU':>10}")
    for name, run in results["runs"].items():
        s = run["summary"]
        others = "n/a" if s["others_cpu_share"] is None else f"{s['others_cpu_share']:.0%}"
        print(f"{name:44} {s['prompt_tokens']:10d} {s['computed_tokens']:9d} {s['token_hit_rate']:8.3f} "
              f"{s['ttft_p50_ms']:12.1f} {s['ttft_p90_ms']:8.1f} {others:>10}")
    runs = {name: run["summary"] for name, run in results["runs"].items()}
    ratios = {
        "TTFT p50, tier off / disk tier (turns 2+)": runs["tier off"]["ttft_p50_ms"] / runs["disk tier"]["ttft_p50_ms"],
        "hit rate, unbounded device - disk tier (points)":
            100 * (runs["unbounded device"]["token_hit_rate"] - runs["disk tier"]["token_hit_rate"]),
        "TTFT p50 after a restart, disk-warm / warm engine":
            runs["next turn: restarted, disk-warm"]["ttft_p50_ms"]
            / runs["next turn: warm engine (unbounded device)"]["ttft_p50_ms"],
        "TTFT p50 after a restart, cold / disk-warm":
            runs["next turn: restarted, cold"]["ttft_p50_ms"] / runs["next turn: restarted, disk-warm"]["ttft_p50_ms"],
        "decode ITL p50, writer saving / tier off (median of the rounds' ratios)": itl["summary"]["p50_ratio_median"],
    }
    print_itl(itl)
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    results["ratios"] = ratios
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
