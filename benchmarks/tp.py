"""Tensor parallelism on this CPU: TP=2 (two processes, one thread each, gloo over loopback) vs TP=1
(one process, one thread) on the same random Llama-shaped model, greedy.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.tp --json results/tp.json

Measured per engine, after a warm-up: decode at batch 1 (seconds per output token), decode at
batch 8 (output tokens per second), and one prefill (prompt tokens per second). The bundled
SmolLM2-135M cannot be sharded in two (9 attention heads, 3 KV heads), so the model is built from
a Llama config (random weights, saved once under --model-dir); its shape is in the JSON. The two
ranks communicate twice per layer (after attention and after the MLP), so TP wins where each
rank's half of the weights takes longer to read than an all-reduce over loopback takes (~1 ms
here on a busy 2-core machine); the JSON records the load average, as other work shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_model(path: Path) -> None:
    """A random Llama of SHAPE saved with save_pretrained (once: reused when `path` has one)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (path / "config.json").is_file():
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param)) if "norm" in name else param.normal_(0, 0.05)
    model.save_pretrained(path)


def measure(path: Path, tp: int, decode_tokens: int, prefill_tokens: int) -> dict:
    from blockserve.engine.llm import LLM
    from blockserve.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (32,), generator=gen).tolist() for _ in range(8)]
    long_prompt = torch.randint(0, SHAPE["vocab_size"], (prefill_tokens,), generator=gen).tolist()
    t0 = time.perf_counter()
    with LLM(str(path), tensor_parallel_size=tp, num_threads=1, kv_cache_memory="512MiB", max_model_len=2048,
             enable_prefix_caching=False) as llm:
        startup = time.perf_counter() - t0
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up

        def timed(batch, params) -> tuple[float, list]:
            start = time.perf_counter()
            outputs = llm.generate(batch, params, use_tqdm=False)
            return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]

        one_s, one_tokens = timed(prompts[:1], greedy)
        eight_s, eight_tokens = timed(prompts, greedy)
        prefill_s, _ = timed([long_prompt], SamplingParams(temperature=0, max_tokens=1))
    return {"tensor_parallel_size": tp, "startup_s": round(startup, 2),
            "decode_batch1_s_per_token": one_s / decode_tokens,
            "decode_batch8_tokens_per_s": 8 * decode_tokens / eight_s,
            "prefill_tokens_per_s": prefill_tokens / prefill_s,
            "tokens": {"batch1": one_tokens, "batch8": eight_tokens}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "blockserve-tp-bench")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--json", type=Path, help="write the raw results here")
    args = parser.parse_args()
    build_model(args.model_dir)
    load_before = os.getloadavg()
    runs = [measure(args.model_dir, tp, args.decode_tokens, args.prefill_tokens) for tp in (1, 2)]
    one, two = runs
    same = one["tokens"] == two["tokens"]
    result = {
        "benchmark": "tensor parallelism, TP=2 vs TP=1, one torch thread per rank, gloo over loopback",
        "model": {**SHAPE, "params_millions": round(sum(_param_counts()) / 1e6, 1), "dtype": "float32"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "runs": [{k: v for k, v in run.items() if k != "tokens"} for run in runs],
        "tp2_over_tp1": {
            "decode_batch1_speedup": one["decode_batch1_s_per_token"] / two["decode_batch1_s_per_token"],
            "decode_batch8_speedup": two["decode_batch8_tokens_per_s"] / one["decode_batch8_tokens_per_s"],
            "prefill_speedup": two["prefill_tokens_per_s"] / one["prefill_tokens_per_s"],
        },
        "greedy_tokens_equal": same,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _param_counts():
    s = SHAPE
    h, i, layers, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    head_dim = h // s["num_attention_heads"]
    attention = h * (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * head_dim + h * h
    yield layers * (attention + 3 * h * i + 2 * h)
    yield 2 * v * h + h  # embedding, untied lm_head, final norm


if __name__ == "__main__":
    main()
