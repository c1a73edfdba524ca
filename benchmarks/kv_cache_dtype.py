"""Quantized KV caches on the bundled model (SmolLM2-135M-Instruct Q4_1): quality against the
float32 cache, capacity, and whole-model decode latency beside native llama.cpp's cache types, in
one run.

    python -m benchmarks.kv_cache_dtype [--quality-tokens 20480] [--contexts 2048 8192] [--batches 1 16]
        [--needle-contexts 1024 2048 4096 8176] [--needle-depths 0.1 0.5 0.9] [--threads 2] [--rounds 3]
        [--skip-llama-cpp] [--llama-types f16 q8_0 q4_0 q8_0/q4_0] [--quality-dtypes int8 fp8 int4 k8v4]
        [--per-layer-4bit] [--json results/kv_cache_dtype.json]

quality    the model over --quality-tokens tokens of English prose in windows of 1024, prefilled
           in chunks of 256 (later chunks read the cache as decodes do), once per KV dtype: mean and
           max KL(float32-cache || dtype) of the next-token distributions, and top-1 agreement.
           float16 is left out (its KL is ~0). The text is CPython's pydoc_data/topics.py (the Python Language Reference, shipped with
           every CPython; PSF license: no public-domain prose is installed on this machine).
           Greedy agreement: 8 chat prompts, 64 new tokens, LLM.chat per dtype against float32.
           k8v4 is int8 keys with rotated 4-bit values (the keys' error costs most KL).
needle     needle-in-a-haystack retrieval (blockserve/bench/needle.py): a 5-digit passphrase at each
           --needle-depths depth of prose prompts of each --needle-contexts length, asked for at the
           end; greedy, per dtype (float32 included): how many answers start with it, and which missed.
capacity   tokens per GiB of K/V from each layout's bytes per token (30 layers, 3 KV heads of 64).
latency    one decode step of the whole model (the engine's native decode stack) with B sequences
           of C cached tokens each, the cache filled with random codes (timing does not depend on
           them): the median of 4 steps after a warm-up. llama.cpp: llama-batched-bench -npp C -ntg 16
           -npl B -pps -fa on -ctk T -ctv T (the prompt prefilled once and shared by the B sequences),
           T_TG / 16, for each --llama-types T (K/V, or K and V apart). Both at --threads threads; each
           round runs every blockserve dtype, then every llama.cpp type; medians over --rounds, each
           with the other processes' CPU share.
           --per-layer-4bit: int4 and k8v4 also with the fused rotary decode call refused for them
           (the per-layer path: kv_quant's PyTorch rotation and write around the decode kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.cpu_share import CpuShare
from benchmarks.peers.native import CpuShare as ProcessCpuShare
from blockserve import LLM, SamplingParams
from blockserve.attention import kv_quant
from blockserve.attention.context import ForwardContext
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import BACKENDS
from blockserve.attention.rotary_decode import RotaryDecode
from blockserve.bench.common import environment
from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.specs import with_kv_cache_dtype
from blockserve.models.default_model import default_model_path
from blockserve.models.loader import load_model
from blockserve.worker.kv_tensors import KVCacheTensors

BLOCK, WINDOW, CHUNK = 16, 1024, 256
DTYPES = ("float16", "int8", "fp8", "int4", "k8v4")  # each against the float32 cache
QUALITY_DTYPES = ("int8", "fp8", "int4", "k8v4")  # float16's KL is ~0 (its rounding is 2^-11 relative)
LLAMA_TYPES = ("f16", "q8_0", "q4_0", "q8_0/q4_0")  # K/V: one type for both, or -ctk / -ctv
NEEDLE_DEPTHS = (0.1, 0.5, 0.9)
NEEDLE_ANSWER = 16  # positions kept after a needle prompt for the answer
CHAT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three uses of copper.",
                "Explain photosynthesis in two sentences.", "How do I reverse a list in Python?",
                "Give me a short packing list for a weekend hike.", "What causes the seasons on Earth?",
                "Summarise the plot of Romeo and Juliet in three sentences.")
LLAMA_BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


class PagedRun:
    """The model over one KV cache of `dtype` (every layer in one group), sequences on contiguous blocks."""

    def __init__(self, model, dtype: str, num_blocks: int):
        groups: dict = {}
        for name, spec in model.kv_cache_specs(BLOCK).items():
            groups.setdefault(with_kv_cache_dtype(spec, dtype), []).append(name)
        (spec, names), = groups.items()
        self.model, self.spec = model, spec
        self.kv = KVCacheTensors(KVCacheConfig((KVCacheGroup(spec, num_blocks, False, tuple(names)),)), device="cpu")

    @torch.inference_mode()
    def step(self, tables: list[list[int]], computed: list[int], tokens: list[list[int]]) -> torch.Tensor:
        layout = BatchLayout.build([len(t) for t in tokens], computed)
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        ctx = ForwardContext(self.kv.layer_caches(), [AttentionMetadata.build(layout, table, BLOCK)])
        ids = torch.tensor([t for row in tokens for t in row])
        return self.model.compute_logits(self.model(ids, layout.positions, ctx))


def prose_tokens(tokenizer, count: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    tokens = tokenizer.encode(text)
    if len(tokens) < count:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than --quality-tokens {count}")
    return tokens[:count]


def window_logprobs(model, dtype: str, window: list[int]) -> torch.Tensor:
    run = PagedRun(model, dtype, WINDOW // BLOCK + 1)
    table = list(range(1, WINDOW // BLOCK + 1))
    rows = [run.step([table], [start], [window[start:start + CHUNK]]) for start in range(0, len(window), CHUNK)]
    return torch.cat(rows).float().log_softmax(-1)


def quality(loaded, tokenizer, count: int, dtypes: tuple[str, ...]) -> dict:
    tokens = prose_tokens(tokenizer, count)
    per_dtype = {d: {"kl": [], "top1": []} for d in dtypes}
    for start in range(0, count, WINDOW):
        window = tokens[start:start + WINDOW]
        reference = window_logprobs(loaded.model, "float32", window)
        for dtype in dtypes:
            got = window_logprobs(loaded.model, dtype, window)
            per_dtype[dtype]["kl"].append((reference.exp() * (reference - got)).sum(-1))
            per_dtype[dtype]["top1"].append(reference.argmax(-1) == got.argmax(-1))
        so_far = "  ".join(f"{d} mean KL {torch.cat(r['kl']).mean().item():.5f}" for d, r in per_dtype.items())
        print(f"  quality: {start + len(window)} / {count} tokens: {so_far}", flush=True)
    out = {}
    for dtype, r in per_dtype.items():
        kl, top1 = torch.cat(r["kl"]), torch.cat(r["top1"])
        out[dtype] = {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(), "p99_kl": kl.quantile(0.99).item(),
                      "top1_agreement": top1.float().mean().item(), "tokens": kl.numel()}
    return out


def scale_granularity(loaded, tokens: list[int]) -> dict:
    """The model's own K and V (every layer, after a float32 prefill of `tokens`) quantised to int8
    with one scale per head vector (kv_quant's layout) or per 32 values (llama.cpp's q8_0 blocks):
    RMS error relative to the vectors' RMS, and the bytes per value."""
    run = PagedRun(loaded.model, "float32", WINDOW // BLOCK + 1)
    run.step([list(range(1, WINDOW // BLOCK + 1))], [0], [tokens[:WINDOW]])
    cache = run.kv.tensors[0][0][:, :, 1:]  # [layers, K/V, blocks, bs, heads, D]: every written slot
    out = {}
    for which, x in (("K", cache[:, 0]), ("V", cache[:, 1])):
        x = x.reshape(-1, x.shape[-1])
        for name, group in (("per head vector", x.shape[-1]), ("per 32 values", 32)):
            grouped = x.reshape(-1, group)
            back = kv_quant.decode(kv_quant.encode(grouped, torch.int8), torch.float32).reshape(x.shape)
            error = ((back - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()
            out[f"{which} {name}"] = {"relative_rms_error": error, "bytes_per_value": 1 + 2 / group}
    return out


def greedy_agreement(path: str, threads: int, dtypes: tuple[str, ...]) -> dict:
    messages = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64)
    outputs = {}
    for dtype in ("auto", *dtypes):
        llm = LLM(path, kv_cache_dtype=dtype, kv_cache_memory="256MiB", max_model_len=1024, num_threads=threads)
        outputs[dtype] = [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)]
        del llm
    out = {}
    for dtype in dtypes:
        pairs = list(zip(outputs["auto"], outputs[dtype]))
        common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in pairs]
        out[dtype] = {"identical": sum(x == y for x, y in pairs), "prompts": len(pairs),
                      "common_prefix_share": sum(common) / sum(len(x) for x, _ in pairs)}
    return out


def needles(path: str, contexts: list[int], depths: list[float], threads: int, dtypes: tuple[str, ...]) -> dict:
    """Per dtype (auto: float32 first), per context: how many of the depths' passphrases come back,
    and the (context, depth) cases whose did not."""
    from blockserve.bench.needle import needle_cases, needle_retrieval

    out = {}
    for dtype in ("auto", *dtypes):
        llm = LLM(path, kv_cache_dtype=dtype, kv_cache_memory="512MiB", max_model_len=max(contexts) + NEEDLE_ANSWER,
                  num_threads=threads)
        cases = needle_cases(llm.get_tokenizer(), contexts, depths)
        with CpuShare() as share:
            found = needle_retrieval(llm, cases)
        name = "float32" if dtype == "auto" else dtype
        out[name] = {str(context): sum(ok for ok, c in zip(found, cases) if c.context == context)
                     for context in contexts}
        print(f"needle {dtype:8s} " + "  ".join(f"{c}: {n}/{len(depths)}" for c, n in out[name].items())
              + f" ({share.others or 0:.0%} others)", flush=True)
        out[name]["missed"] = [[c.context, c.depth] for ok, c in zip(found, cases) if not ok]
        out[name]["others_cpu_share"] = share.others
        del llm
    return out


def capacity(model) -> dict:
    specs = list(model.kv_cache_specs(BLOCK).values())
    layers, (heads, dim) = len(specs), (specs[0].num_kv_heads, specs[0].head_size)
    out = {}
    for dtype in ("float32", *DTYPES):
        per_token = sum(with_kv_cache_dtype(s, dtype).page_size_bytes for s in specs) / BLOCK
        out[f"blockserve {dtype}"] = {"bytes_per_token": per_token, "tokens_per_gib": 2**30 / per_token}
    for kind in LLAMA_TYPES:
        k, _, v = kind.partition("/")
        per_token = layers * heads * dim * (LLAMA_BYTES_PER_VALUE[k] + LLAMA_BYTES_PER_VALUE[v or k])
        out[f"llama.cpp {kind}"] = {"bytes_per_token": per_token, "tokens_per_gib": 2**30 / per_token}
    return out


def fill_random(run: PagedRun) -> None:
    """Every block: random codes with a small scale (quantized), or random 16-bit values."""
    gen = torch.Generator().manual_seed(0)
    for tensor in run.kv.tensors[0]:
        for layer in tensor:  # one layer at a time: bounded temporary memory
            if kv_quant.is_quantized(layer):
                tail = kv_quant.scale_bytes(layer.dtype)
                codes = layer.view(torch.uint8)[..., :-tail]
                codes.copy_(torch.randint(0, 0x7E, codes.shape, generator=gen, dtype=torch.uint8))
                layer[..., -tail:].view(torch.float16).fill_(1 / 64)
            else:
                layer.copy_(torch.randn(layer.shape, generator=gen).to(layer.dtype))


def decode_latency_ms(loaded, dtype: str, context: int, batch: int) -> dict:
    steps = 4
    per_seq = -(-(context + steps + 1) // BLOCK)
    run = PagedRun(loaded.model, dtype, batch * per_seq + 1)
    fill_random(run)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    times = []
    with CpuShare() as share:
        position = context - steps - 1  # the last step attends `context` tokens (within the model's positions)
        run.step(tables, [position] * batch, [[1]] * batch)  # warm-up (builds the decode plan)
        position += 1
        for _ in range(steps):
            start = time.perf_counter()
            run.step(tables, [position] * batch, [[1]] * batch)
            times.append(time.perf_counter() - start)
            position += 1
    del run
    return {"ms": 1e3 * statistics.median(times), "others_cpu_share": share.others}


@contextlib.contextmanager
def per_layer_4bit():
    """Within it, the fused rotary decode call (and so the native decode stack) refuses rotated 4-bit and
    split caches, which then take the per-layer path."""
    fixed = RotaryDecode.fixed

    def refusing(self, cache, dtype):
        if kv_quant.is_rotated(cache.k_cache) or kv_quant.is_rotated(cache.v_cache):
            return None
        return fixed(self, cache, dtype)

    RotaryDecode.fixed = refusing
    try:
        yield
    finally:
        RotaryDecode.fixed = fixed


def median_of(rounds: list[dict]) -> dict:
    """One cell's rounds: the median time and the median of the other processes' CPU share."""
    shares = [r["others_cpu_share"] for r in rounds if r["others_cpu_share"] is not None]
    return {"ms": statistics.median(r["ms"] for r in rounds),
            "others_cpu_share": statistics.median(shares) if shares else None, "rounds": rounds}


def llama_bin() -> Path:
    here = Path(__file__).resolve().parent / "peers" / "build_llama_cpp.sh"
    out = subprocess.run([str(here), "native", "llama-batched-bench"], check=True, capture_output=True,
                         text=True).stdout
    return Path(out.strip().splitlines()[-1])


def llama_decode_ms(bin_dir: Path, model: str, kind: str, context: int, batch: int, threads: int) -> dict:
    generated = 16
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", model, "-c", str(context + batch * (generated + 16)),
           "-b", "2048", "-ub", "512", "-npp", str(context), "-ntg", str(generated), "-npl", str(batch), "-pps", "-kvu",
           "-fa", "on", "-ctk", kind.partition("/")[0], "-ctv", kind.partition("/")[2] or kind, "-t", str(threads),
           "-tb", str(threads)]
    with ProcessCpuShare() as share:  # llama.cpp's own CPU time (a reaped child's) is not the others'
        proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    fields = [float(x) for x in rows[-1].strip("| ").split("|")]
    t_tg, tg = fields[6], fields[1]
    return {"ms": 1e3 * t_tg / tg, "others_cpu_share": share.others_share, "command": " ".join(cmd)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quality-tokens", type=int, default=20480)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    # The bundled model holds 8,192 positions: the longest prompt leaves room for the answer's 16 tokens.
    ap.add_argument("--needle-contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192 - NEEDLE_ANSWER])
    ap.add_argument("--needle-depths", type=float, nargs="+", default=list(NEEDLE_DEPTHS),
                    help="where the passphrase sits in each needle prompt (0: its start, 1: before the question)")
    ap.add_argument("--quality-dtypes", nargs="+", default=list(QUALITY_DTYPES), choices=QUALITY_DTYPES,
                    help="the dtypes of the quality and needle parts (float32 is always the reference)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-needle", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--llama-types", nargs="+", default=list(LLAMA_TYPES), choices=LLAMA_TYPES,
                    help="llama.cpp's cache types in the latency cells (K/V, or K and V apart)")
    ap.add_argument("--per-layer-4bit", action="store_true", help="int4 and k8v4 also on the per-layer path")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(default_model_path())
    loaded = load_model(path, BACKENDS["exact"])
    results: dict = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    results["capacity"] = capacity(loaded.model)
    for name, c in results["capacity"].items():
        print(f"capacity {name:22s} {c['bytes_per_token']:8.0f} B/token {c['tokens_per_gib']:>12,.0f} tokens/GiB")
    if not args.skip_quality:
        tokenizer = LLM(path, kv_cache_memory="64MiB", max_model_len=1024).get_tokenizer()
        results["scale_granularity"] = scale_granularity(loaded, prose_tokens(tokenizer, WINDOW))
        for name, r in results["scale_granularity"].items():
            print(f"int8 {name:20s} relative RMS error {r['relative_rms_error']:.5f}, {r['bytes_per_value']:.4f} B/value")
        results["quality"] = quality(loaded, tokenizer, args.quality_tokens, tuple(args.quality_dtypes))
        results["greedy"] = greedy_agreement(path, args.threads, tuple(args.quality_dtypes))
        for dtype in args.quality_dtypes:
            q, g = results["quality"][dtype], results["greedy"][dtype]
            print(f"quality {dtype:8s} mean KL {q['mean_kl']:.5f} max {q['max_kl']:.4f} p99 {q['p99_kl']:.5f} "
                  f"top-1 {q['top1_agreement']:.4f} over {q['tokens']} tokens; greedy identical "
                  f"{g['identical']}/{g['prompts']}, common prefix {g['common_prefix_share']:.2f}")
    if not args.skip_needle:
        results["needle"] = needles(path, args.needle_contexts, args.needle_depths, args.threads,
                                    tuple(args.quality_dtypes))
    bin_dir = None if args.skip_llama_cpp or args.skip_latency else llama_bin()
    gguf = path if path.endswith(".gguf") else str(next(Path(path).glob("*.gguf")))
    results["latency"] = []
    for context in [] if args.skip_latency else args.contexts:
        for batch in args.batches:
            runs: dict[str, list[dict]] = {}
            row: dict = {"context": context, "batch": batch}
            results["latency"].append(row)

            def record(name: str, run: dict) -> None:
                runs.setdefault(name, []).append(run)
                row[name] = median_of(runs[name])
                save(results, args.json)

            for r in range(args.rounds):
                for dtype in DTYPES:
                    record(f"blockserve {dtype}", decode_latency_ms(loaded, dtype, context, batch))
                    if args.per_layer_4bit and dtype in ("int4", "k8v4"):
                        with per_layer_4bit():
                            record(f"blockserve {dtype} per-layer", decode_latency_ms(loaded, dtype, context, batch))
                for kind in [] if bin_dir is None else args.llama_types:
                    record(f"llama.cpp {kind}", llama_decode_ms(bin_dir, gguf, kind, context, batch, args.threads))
                cells = "  ".join(f"{k} {v['ms']:.1f} ms ({v['others_cpu_share'] or 0:.0%} others)"
                                  for k, v in row.items() if isinstance(v, dict))
                print(f"decode step, context {context}, batch {batch}, medians of {r + 1} round(s): {cells}",
                      flush=True)
    save(results, args.json)
    return 0


def save(results: dict, path: Path | None) -> None:
    """The results so far, rewritten after every run of a latency cell: a run cut short keeps what it
    measured (each cell's "rounds" say how many ran)."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
