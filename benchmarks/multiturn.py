"""Multi-turn chat with a shared system prompt, on a hybrid model and a full-attention model of
similar size, prefix caching on and off: per turn, TTFT p50/p90 and the prompt tokens actually
computed.

16 conversations x 8 turns; each next turn (history + reply + a new message) is added as soon as
the previous one finishes, so turns of different conversations interleave as a server sees them.
Both models are tiny random ones built here (timing only): a Qwen3-Next shape (3 Gated DeltaNet
layers : 1 attention layer, checkpoint stride 64) and a Qwen3 shape with the same widths.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.multiturn --json results/hybrid_prefix_multiturn.json
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3NextConfig

from blockserve import LLM, SamplingParams
from blockserve.bench.common import environment, percentile, print_environment, write_json

VOCAB = 4096
WIDTHS = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)


def build_models(root: str) -> dict[str, str]:
    torch.manual_seed(0)
    configs = {
        "hybrid (Qwen3-Next shape)": Qwen3NextConfig(
            **WIDTHS, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, mlp_only_layers=[0, 1, 2, 3],
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
        "full attention (Qwen3 shape)": Qwen3Config(**WIDTHS),
    }
    paths = {}
    for i, (name, config) in enumerate(configs.items()):
        path = f"{root}/model{i}"
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        paths[name] = path
    return paths


def run(llm: LLM, conversations: int, turns: int, seed: int = 0) -> list[dict]:
    """Per turn: TTFTs (s), prompt tokens, cached tokens."""
    rng = random.Random(seed)
    engine = llm.engine
    system = [rng.randrange(VOCAB) for _ in range(256)]
    history = {c: list(system) for c in range(conversations)}
    turn = dict.fromkeys(range(conversations), 0)
    per_turn = [{"ttft": [], "prompt_tokens": 0, "cached_tokens": 0} for _ in range(turns)]
    added, first = {}, {}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def add(c: int) -> None:
        prompt = history[c] + [rng.randrange(VOCAB) for _ in range(rng.randint(32, 64))]
        rid = f"c{c}t{turn[c]}"
        engine.add_request(rid, prompt, params)
        added[rid] = (c, time.perf_counter(), prompt)

    for c in range(conversations):
        add(c)
    while engine.has_unfinished_requests():
        for output in engine.step():
            rid = output.request_id
            if rid not in first and output.outputs[0].token_ids:
                first[rid] = time.perf_counter()
            if output.finished:
                c, start, prompt = added.pop(rid)
                stats = per_turn[turn[c]]
                stats["ttft"].append(first.pop(rid) - start)
                stats["prompt_tokens"] += len(prompt)
                stats["cached_tokens"] += output.num_cached_tokens
                history[c] = prompt + output.outputs[0].token_ids
                turn[c] += 1
                if turn[c] < turns:
                    add(c)
    return per_turn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    env = environment()
    print_environment(env)
    results = {"environment": env, "runs": {}}
    with tempfile.TemporaryDirectory() as root:
        for name, path in build_models(root).items():
            for caching in (True, False):
                llm = LLM(path, enable_prefix_caching=caching, kv_cache_memory="2GiB", max_model_len=4096,
                          num_threads=args.num_threads)
                per_turn = run(llm, args.conversations, args.turns)
                key = f"{name}, caching {'on' if caching else 'off'}"
                results["runs"][key] = per_turn
                print(f"\n{key}")
                print("turn  TTFT p50 (ms)  p90 (ms)  prompt tokens  computed  token hit rate")
                for k, t in enumerate(per_turn):
                    computed = t["prompt_tokens"] - t["cached_tokens"]
                    print(f"{k + 1:>4}  {percentile(t['ttft'], 50) * 1e3:13.1f}  {percentile(t['ttft'], 90) * 1e3:8.1f}"
                          f"  {t['prompt_tokens']:13d}  {computed:8d}  {t['cached_tokens'] / t['prompt_tokens']:14.3f}")
                del llm
    print("\nturns 2+: computed prompt tokens, caching on / off; token hit rate")
    for name in ("hybrid (Qwen3-Next shape)", "full attention (Qwen3 shape)"):
        on, off = results["runs"][f"{name}, caching on"], results["runs"][f"{name}, caching off"]
        computed_on = sum(t["prompt_tokens"] - t["cached_tokens"] for t in on[1:])
        computed_off = sum(t["prompt_tokens"] - t["cached_tokens"] for t in off[1:])
        rate = sum(t["cached_tokens"] for t in on) / sum(t["prompt_tokens"] for t in on)
        results[f"{name}: turns 2+ computed on/off"] = computed_on / computed_off
        results[f"{name}: token hit rate"] = rate
        print(f"{name}: {computed_on} / {computed_off} = {computed_on / computed_off:.3f}; hit rate {rate:.3f}")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
