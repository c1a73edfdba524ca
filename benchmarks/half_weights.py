"""A bfloat16 checkpoint on the CPU: its weights kept in 16 bits (dtype auto) against widened at load
(--dtype float32), side by side on the same machine; and, with --kernels, the 16-bit matmul's paths
per row count (the crossover models/half_linear.py's KERNEL_ROWS holds).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.half_weights --json results/half_weights_avx512.json
    OMP_WAIT_POLICY=PASSIVE BLOCKSERVE_NATIVE_ISA=avx2 python -m benchmarks.half_weights
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.half_weights --kernels

The checkpoint: `bundled` (default) is the bundled SmolLM2-135M-Instruct dequantised by
transformers' GGUF loader and saved as bfloat16 safetensors; `random-0.5b` a random Llama of
~0.43B parameters saved in bfloat16 (timing only). Both are built once under --model-dir.

Each engine runs in a process of its own, so its peak RSS is its own: the process's high-water mark
(VmHWM) after the engine is built (the load's peak; the KV cache is --kv-cache-memory on top) and
the weights' resident bytes per dtype, with the high-water mark before the engine (the interpreter,
torch, the kernels) beside it. Then, greedy, ignoring EOS: batch 1 and batch 16 decode, each
timed as max_tokens=N against max_tokens=1 on the same prompts (the difference over N - 1 steps is
the inter-token latency, prefill excluded); the median of --rounds, engines alternating. Each
figure records the CPU flags and the other processes' CPU share (benchmarks/cpu_share.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RANDOM_SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPT_IDS = 32000  # prompts draw token ids below this: within both checkpoints' vocabularies
MODES = {"bf16-kept": "auto", "float32": "float32"}  # label -> --dtype
KERNEL_ROWS_MEASURED = (1, 2, 4, 8, 16, 32, 64, 128)


def build_checkpoint(kind: str, root: Path) -> Path:
    """The bfloat16 checkpoint `kind` under `root` (built once)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    path = root / f"{kind}-bf16"
    if (path / "config.json").is_file():
        return path
    if kind == "bundled":
        from blockserve.models.default_model import default_model_path

        gguf = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
        # transformers refuses to save a model it read from GGUF: the config and tensors by hand
        # (without the tied head, which shares the embedding's storage)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        tied = model.config.tie_word_embeddings
        save_file({name: tensor.to(torch.bfloat16).contiguous() for name, tensor in model.state_dict().items()
                   if not (tied and name == "lm_head.weight")}, path / "model.safetensors", metadata={"format": "pt"})
        return path
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**RANDOM_SHAPE))
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(1 + 0.1 * torch.randn_like(param)) if "norm" in name else param.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def measure_engine(path: Path, dtype: str, decode_tokens: int, kv_cache_memory: str) -> dict:
    """One engine in this process: its memory, then batch-1 and batch-16 decode ITL."""
    from benchmarks.cpu_share import CpuShare
    from blockserve.engine.llm import LLM
    from blockserve.models.weight_memory import peak_rss_bytes
    from blockserve.sampling_params import SamplingParams

    before = peak_rss_bytes()  # the interpreter, torch and the native kernels
    started = time.perf_counter()
    llm = LLM(str(path), dtype=dtype, kv_cache_memory=kv_cache_memory, max_model_len=1024,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - started
    result = {"dtype": dtype, "load_s": round(load_s, 2), "peak_rss_before_load_bytes": before,
              "peak_rss_after_load_bytes": peak_rss_bytes(),
              "weights_resident_bytes": llm.engine.weights_resident_bytes}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, PROMPT_IDS, (16,), generator=gen).tolist() for _ in range(16)]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    def seconds(batch: list, tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    for batch in (1, 16):
        with CpuShare() as share:
            itl = (seconds(prompts[:batch], decode_tokens) - seconds(prompts[:batch], 1)) / (decode_tokens - 1)
        result[f"batch{batch}"] = {"itl_ms": round(itl * 1e3, 3), "tokens_per_s": round(batch / itl, 1),
                                   "others_cpu_share": share.others}
    return result


def kernel_rows(rounds: int) -> list[dict]:
    """Per SmolLM2 / 0.5B-Llama shape and build: the kernel, the tiled converting GEMM and the
    float32 GEMM over the widened weights, ms per call (fastest of `rounds` sweeps of 8 weights)."""
    from benchmarks.cpu_share import CpuShare
    from blockserve.models.half_linear import converted_matmul
    from blockserve.native.extension import half_matmul_ops

    rows_out = []
    for avx2 in (False, True):
        ops = half_matmul_ops(without_avx512=avx2)
        if ops is None or not ops.half_matmul_lanes():
            continue
        for out_features, in_features in ((3072, 576), (576, 1536), (8192, 1024), (1024, 4096)):
            weights = [torch.randn(out_features, in_features).to(torch.bfloat16) for _ in range(8)]
            wide = [w.float() for w in weights]
            for rows in KERNEL_ROWS_MEASURED:
                x = torch.randn(rows, in_features)
                paths = {"kernel": lambda: [ops.half_matmul(x, w) for w in weights],
                         "converted_gemm": lambda: [converted_matmul(x, w) for w in weights],
                         "float32_gemm": lambda: [x @ w.t() for w in wide]}
                best = {name: float("inf") for name in paths}
                with CpuShare() as share:
                    for _ in range(rounds):
                        for name, run in paths.items():
                            start = time.perf_counter()
                            run()
                            best[name] = min(best[name], (time.perf_counter() - start) / len(weights))
                row = {"lanes": ops.half_matmul_lanes(), "shape": [out_features, in_features], "rows": rows,
                       **{f"{name}_ms": round(s * 1e3, 4) for name, s in best.items()},
                       "others_cpu_share": share.others}
                print(json.dumps(row), flush=True)
                rows_out.append(row)
    return rows_out


def cpu_flags() -> list[str]:
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "f16c", "fma", "amx")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bundled", "random-0.5b"), default="bundled")
    parser.add_argument("--model-dir", type=Path,
                        default=Path(os.environ.get("TMPDIR", "/tmp")) / "blockserve-half-weights-bench")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--kernels", action="store_true", help="the matmul paths per row count instead")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--one", nargs=2, metavar=("PATH", "DTYPE"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_engine(Path(args.one[0]), args.one[1], args.decode_tokens, args.kv_cache_memory)))
        return
    header = {"cpu_flags": cpu_flags(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "isa": os.environ.get("BLOCKSERVE_NATIVE_ISA", "native"), "threads": torch.get_num_threads()}
    if args.kernels:
        results = {**header, "kernels": kernel_rows(args.rounds)}
    else:
        path = build_checkpoint(args.model, args.model_dir)
        runs: dict[str, list[dict]] = {label: [] for label in MODES}
        for _ in range(args.rounds):
            for label, dtype in MODES.items():  # alternating, so drift in the neighbours' load hits both
                child = subprocess.run([sys.executable, "-m", "benchmarks.half_weights", "--one", str(path), dtype,
                                        "--decode-tokens", str(args.decode_tokens),
                                        "--kv-cache-memory", args.kv_cache_memory],
                                       capture_output=True, text=True, check=True)
                runs[label].append(json.loads(child.stdout.strip().splitlines()[-1]))
                print(label, runs[label][-1], flush=True)
        summary = {label: _median(results) for label, results in runs.items()}
        kept, wide = summary["bf16-kept"], summary["float32"]
        summary["ratios_kept_over_float32"] = {
            "peak_rss": kept["peak_rss_after_load_gib"] / wide["peak_rss_after_load_gib"],
            "weights_resident": kept["weights_resident_gib"] / wide["weights_resident_gib"],
            "batch1_itl": kept["batch1_itl_ms"] / wide["batch1_itl_ms"],
            "batch16_itl": kept["batch16_itl_ms"] / wide["batch16_itl_ms"]}
        results = {**header, "model": args.model, "decode_tokens": args.decode_tokens, "summary": summary,
                   "runs": runs}
        print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def _median(results: list[dict]) -> dict:
    """The medians over rounds of one engine's figures (GiB, ms) and the largest neighbour share."""
    def med(values) -> float:
        return round(statistics.median(values), 3)

    return {"peak_rss_before_load_gib": med(r["peak_rss_before_load_bytes"] / 2**30 for r in results),
            "peak_rss_after_load_gib": med(r["peak_rss_after_load_bytes"] / 2**30 for r in results),
            "weights_resident_gib": med(sum(r["weights_resident_bytes"].values()) / 2**30 for r in results),
            "weights_by_dtype_gib": {k: round(v / 2**30, 3) for k, v in results[0]["weights_resident_bytes"].items()},
            "load_s": med(r["load_s"] for r in results),
            **{f"batch{b}_itl_ms": med(r[f"batch{b}"]["itl_ms"] for r in results) for b in (1, 16)},
            **{f"batch{b}_tokens_per_s": med(r[f"batch{b}"]["tokens_per_s"] for r in results) for b in (1, 16)},
            "others_cpu_share_max": max((r[f"batch{b}"]["others_cpu_share"] or 0) for r in results for b in (1, 16))}


if __name__ == "__main__":
    main()
