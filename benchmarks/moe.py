"""Mixture-of-experts decode on the CPU: blockserve against transformers (the same float32
safetensors) and against native llama.cpp (the same GGUF), decode tok/s at batch 1 and 16, and the
experts' share of blockserve's decode time.

    python -m benchmarks.moe make DIR              a random Qwen3-MoE (SHAPE below) saved in DIR/hf
                                                   (float32 safetensors), DIR/model-f16.gguf written
                                                   with gguf-py as llama.cpp's converter names it, and
                                                   DIR/model-<TYPE>.gguf by llama-quantize
    python -m benchmarks.moe run DIR [--batches 1 16] [--new-tokens 16] [--threads 2] [--quant Q4_K_M]
        [--systems blockserve-hf transformers blockserve-gguf llama.cpp]
        [--activations float32 int8] [--rounds 1] [--json PATH]

blockserve-gguf runs once per `--activations` (the engine's --quantized-activations: float32, its
default, or int8, llama.cpp's own precision: activations rounded per block of 32 to 8 bits, integer
dots), each row naming its precision.

`--rounds R` runs every system R times in turn and reports the medians (each round's figures kept in
the JSON) and blockserve-gguf's rate over llama.cpp's in the same round per precision and batch
(each round's ratio and their median).

Decode tok/s: every request of a batch gets the same 16-token random prompt prefix-free (prefix
caching off) and `--new-tokens` greedy tokens, EOS ignored; the rate is (batch x (new - 1)) / (the
time of the run with `new` tokens - the time of the run with 1 token), so prefill and start-up are
not counted. blockserve and transformers run in this process (transformers: model.generate with
min_new_tokens = max_new_tokens, its own expert implementation); llama.cpp's `llama-batched-bench
-npp 16 -ntg N -npl B` (its S_TG, decode tokens per second over the batch), a separate process.
Parts' shares (blockserve): the time inside the MoE layers' experts (moe.Experts,
gguf_block_experts.GGUFBlockExperts), the attention layers (projections included), the routers and
the head during the decode tokens, over the decode time. Each figure carries the other processes' CPU share
(benchmarks/cpu_share.py) and the CPU's flags go into the JSON.

The shape (SHAPE): Qwen3-MoE with hidden 2048, 16 layers, 16 query / 4 KV heads of 128, 16 experts
of intermediate 768, top-8 (renormalised), vocabulary 32768 (untied): 0.9B parameters active per
token, 1.5B in all (6 GB float32; Q4_K_M 0.9 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.cpu_share import CpuShare
from blockserve.engine.thread_governor import usable_cpus

LLAMA_CPP = Path.home() / ".cache" / "blockserve-peers" / "llama.cpp-0.3.36-4b4fbe1c1229"
SHAPE = dict(vocab_size=32768, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=16, num_experts_per_tok=8,
             moe_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPT_LEN = 16
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate": "ffn_gate_inp"}


def make(directory: Path, quant: str) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import gguf

    hf = directory / "hf"
    if not (hf / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**SHAPE), dtype=torch.float32)
        model.save_pretrained(hf)
        del model
    f16 = directory / "model-f16.gguf"
    if not f16.is_file():
        config = SHAPE
        writer = gguf.GGUFWriter(f16, "qwen3moe")
        for add, value in ((writer.add_context_length, config["max_position_embeddings"]),
                           (writer.add_block_count, config["num_hidden_layers"]),
                           (writer.add_embedding_length, config["hidden_size"]),
                           (writer.add_feed_forward_length, config["intermediate_size"]),
                           (writer.add_head_count, config["num_attention_heads"]),
                           (writer.add_head_count_kv, config["num_key_value_heads"]),
                           (writer.add_key_length, config["head_dim"]), (writer.add_value_length, config["head_dim"]),
                           (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 10000.0),
                           (writer.add_expert_count, config["num_experts"]),
                           (writer.add_expert_used_count, config["num_experts_per_tok"]),
                           (writer.add_expert_feed_forward_length, config["moe_intermediate_size"])):
            add(value)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        tokens = [f"t{i}" for i in range(config["vocab_size"])]
        tokens[0], tokens[2] = "t", "1"  # the one merge's parts, so a BPE built from the file accepts it
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.NORMAL] * config["vocab_size"])
        writer.add_token_scores([0.0] * config["vocab_size"])
        writer.add_token_merges(["t 1"])  # llama.cpp refuses a BPE vocabulary without merges
        files = [hf / "model.safetensors"] if (hf / "model.safetensors").is_file() else \
            sorted(hf.glob("model-*.safetensors"))
        pending: dict = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name).float()
                    for gguf_name, array in _gguf_tensors(name, tensor, pending):
                        writer.add_tensor(gguf_name, array.astype(np.float16 if array.ndim > 1 and "gate_inp" not in
                                                                  gguf_name else np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    quantized = directory / f"model-{quant}.gguf"
    if not quantized.is_file():
        subprocess.run([str(LLAMA_CPP / "build" / "bin" / "llama-quantize"), str(f16), str(quantized), quant,
                        str(os.cpu_count())], check=True)


def _gguf_tensors(name: str, tensor: torch.Tensor, pending: dict):
    """llama.cpp's names for one transformers tensor: per-expert ones (as save_pretrained writes
    them) held in `pending` until the layer's stack [E, rows, columns] is complete."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    array = tensor.numpy()
    if name in top:
        yield top[name], array
        return
    _, _, layer, rest = name.split(".", 3)
    per_expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest)
    if per_expert:
        stack = pending.setdefault((layer, per_expert[2]), {})
        stack[int(per_expert[1])] = array
        if len(stack) == SHAPE["num_experts"]:
            del pending[(layer, per_expert[2])]
            yield f"blk.{layer}.ffn_{per_expert[2]}_exps.weight", np.stack([stack[e] for e in sorted(stack)])
        return
    module, _, leaf = rest.rpartition(".")
    yield f"blk.{layer}.{_GGUF_LAYER[module]}.{leaf}", array


class PartTimer:
    """Seconds spent in each part of blockserve's forward, summed (hooks): PARTS' modules, and the
    head (the model's compute_logits)."""

    PARTS = ("experts", "attention", "router", "head")

    def __init__(self, model):
        from blockserve.models.gguf_block_experts import GGUFBlockExperts
        from blockserve.models.llama import LlamaAttention
        from blockserve.models.moe import Experts, SparseMoe

        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        for module in model.modules():
            if isinstance(module, (Experts, GGUFBlockExperts)):
                self._time("experts", module)
            elif isinstance(module, LlamaAttention):
                self._time("attention", module)
            elif isinstance(module, SparseMoe):
                self._time("router", module.gate)
        logits = model.compute_logits

        def timed_logits(*args, **kwargs):
            start = time.perf_counter()
            try:
                return logits(*args, **kwargs)
            finally:
                self.seconds["head"] += time.perf_counter() - start

        model.compute_logits = timed_logits

    def _time(self, part: str, module) -> None:
        started = []
        module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
        module.register_forward_hook(lambda *_: self.seconds.__setitem__(
            part, self.seconds[part] + time.perf_counter() - started.pop()))


def _prompts(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(0, SHAPE["vocab_size"], (batch, PROMPT_LEN), generator=gen).tolist()


def _decode_rate(generate, batch: int, new_tokens: int, timer=None) -> dict:
    """(batch x (new - 1)) / (time(new tokens) - time(1 token)), and each timed part's share of that time."""
    generate(batch, 2)  # warm-up
    runs = {}
    with CpuShare() as share:
        for n in (1, new_tokens):
            before = dict(timer.seconds) if timer else {}
            start = time.perf_counter()
            generate(batch, n)
            runs[n] = (time.perf_counter() - start, {k: timer.seconds[k] - before[k] for k in before})
    decode = runs[new_tokens][0] - runs[1][0]
    result = {"batch": batch, "decode_tok_s": batch * (new_tokens - 1) / decode, "others_cpu_share": share.others}
    for part in runs[new_tokens][1]:
        result[f"{part}_share"] = (runs[new_tokens][1][part] - runs[1][1][part]) / decode
    return result


def run_blockserve(source: str, batches, new_tokens: int, activations: str = "float32") -> list[dict]:
    from blockserve import LLM, SamplingParams
    from blockserve.attention.paged_attention import BACKENDS
    from blockserve.models.loader import load_model

    loaded = load_model(source, BACKENDS["exact"], quantized_activations=activations)
    llm = LLM(loaded, enable_prefix_caching=False, max_model_len=PROMPT_LEN + new_tokens + 8,
              max_num_seqs=max(batches), quantized_activations=activations)
    timer = PartTimer(loaded.model)

    def generate(batch: int, n: int):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate(_prompts(batch), params, use_tqdm=False)

    with llm:
        return [{**_decode_rate(generate, b, new_tokens, timer), "activations": activations} for b in batches]


def run_transformers(hf: Path, batches, new_tokens: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()

    def generate(batch: int, n: int):
        with torch.no_grad():
            model.generate(torch.tensor(_prompts(batch)), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    return [_decode_rate(generate, b, new_tokens) for b in batches]


def run_llama_cpp(gguf_path: Path, batches, new_tokens: int, threads: int) -> list[dict]:
    out = []
    for b in batches:
        command = [str(LLAMA_CPP / "build" / "bin" / "llama-batched-bench"), "-m", str(gguf_path), "-c",
                   str(b * (PROMPT_LEN + new_tokens) + 64), "-npp", str(PROMPT_LEN), "-ntg", str(new_tokens),
                   "-npl", str(b), "-t", str(threads), "-b", "2048", "-ub", "512"]
        children, start = _children_seconds(), time.perf_counter()
        with CpuShare() as share:
            text = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        own = (_children_seconds() - children) / ((time.perf_counter() - start) * len(usable_cpus()))
        row = next(line for line in text.splitlines() if re.match(rf"\|\s*{PROMPT_LEN}\s*\|\s*{new_tokens}\s*\|\s*{b}\s*\|", line))
        cells = [c.strip() for c in row.strip("|").split("|")]
        others = None if share.others is None else max(0.0, share.others - own)
        out.append({"batch": b, "decode_tok_s": float(cells[7]), "others_cpu_share": others,
                    "activations": "int8 (its q8 dots)", "note": "llama-batched-bench S_TG"})
    return out


def _children_seconds() -> float:
    """CPU seconds of this process's finished children (llama.cpp's run, so its share is not the others')."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _medians(runs: list[list[dict]]) -> list[dict]:
    """Per row (activations, batch) of a system: the median rate and others' share over the rounds,
    each round's figures kept."""
    out = []
    for i, row in enumerate(runs[0]):
        taken = [run[i] for run in runs]
        shares = [r["others_cpu_share"] for r in taken if r["others_cpu_share"] is not None]
        median = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in taken),
                  "others_cpu_share": statistics.median(shares) if shares else None,
                  "rounds": [{k: v for k, v in r.items() if k == "decode_tok_s" or k.endswith("_share")}
                             for r in taken]}
        for key in (k for k in row if k.endswith("_share") and k != "others_cpu_share"):
            median[key] = statistics.median(r[key] for r in taken)
        out.append({**row, **median})
    return out


def _ratios(blockserve: list[list[dict]], peer: list[list[dict]]) -> list[dict]:
    """blockserve-gguf's rate over llama.cpp's in the same round, per activations and batch: each
    round's and their median (the two ran minutes apart, under the same neighbours)."""
    out = []
    for i, row in enumerate(blockserve[0]):
        ratios = [ours[i]["decode_tok_s"] / next(p["decode_tok_s"] for p in theirs if p["batch"] == row["batch"])
                  for ours, theirs in zip(blockserve, peer)]
        out.append({"activations": row["activations"], "batch": row["batch"], "median": statistics.median(ratios),
                    "rounds": ratios})
    return out


def _cpu_flags() -> list[str]:
    line = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    return sorted(f for f in line.split() if f.startswith(("avx", "fma", "f16c", "amx")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("make", "run"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize type of the GGUF compared")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--systems", nargs="+", default=["blockserve-hf", "transformers", "blockserve-gguf", "llama.cpp"])
    parser.add_argument("--activations", nargs="+", default=["float32"], choices=("float32", "int8", "int16"),
                        help="blockserve-gguf's --quantized-activations, one run each")
    parser.add_argument("--rounds", type=int, default=1, help="every system run this many times, in turn; "
                        "the medians are reported")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.action == "make":
        make(args.directory, args.quant)
        return
    torch.set_num_threads(args.threads)
    gguf_path = args.directory / f"model-{args.quant}.gguf"
    results = {"shape": SHAPE, "threads": args.threads, "cpu_flags": _cpu_flags(), "new_tokens": args.new_tokens,
               "gguf": gguf_path.name, "systems": {}}
    runners = {"blockserve-hf": lambda: run_blockserve(str(args.directory / "hf"), args.batches, args.new_tokens),
               "transformers": lambda: run_transformers(args.directory / "hf", args.batches, args.new_tokens),
               "blockserve-gguf": lambda: [row for activations in args.activations
                                           for row in run_blockserve(str(gguf_path), args.batches, args.new_tokens,
                                                                     activations)],
               "llama.cpp": lambda: run_llama_cpp(gguf_path, args.batches, args.new_tokens, args.threads)}
    rounds = {system: [] for system in args.systems}
    for _ in range(args.rounds):
        for system in args.systems:
            rounds[system].append(runners[system]())
            print(system, json.dumps(rounds[system][-1]), flush=True)
    results["systems"] = {system: _medians(runs) for system, runs in rounds.items()}
    if "llama.cpp" in rounds and "blockserve-gguf" in rounds:
        results["ratios_to_llama_cpp"] = _ratios(rounds["blockserve-gguf"], rounds["llama.cpp"])
        for r in results["ratios_to_llama_cpp"]:
            print(f"blockserve-gguf {r['activations']} batch {r['batch']}: {r['median']:.2f}x llama.cpp "
                  f"(per round: {', '.join(f'{x:.2f}' for x in r['rounds'])})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
