"""Structured outputs, measured on this CPU with the bundled SmolLM2 (vocabulary 49,152).

`engines`: which grammar engine. llguidance, xgrammar and outlines-core; for each workload (a simple object schema, a nested schema with arrays and enums, a regex, a
choice) and each engine:
- compile: seconds from the grammar text to a ready matcher (median of `--repeats` fresh
  compiles; xgrammar's compile cache is off, so each compile is real);
- mask: seconds to fill one token bitmask [ceil(V/32)] int32, median over the steps of one valid
  output (the same token ids for every engine: the HF tokenization of a fixed valid answer), each
  step checking that the next token is allowed before consuming it.

    python -m benchmarks.structured_outputs engines [--repeats 5] [--out results/structured_outputs_engines.json]

An engine that is not installed, or rejects a workload, is reported as such, not skipped silently.

`batch`: what a constraint costs per token in the engine. 16 chat requests decode `--max-tokens`
tokens each, greedy, as one batch: all unconstrained (ignore_eos, so every row runs to the
end), then half of them under a JSON schema whose one string field is too long to finish within
the run (so the constrained rows run to the end too), then all 16 constrained. Each mix runs
`--repeats` times, interleaved. Reported, as medians over all decode steps (robust to a busy
machine): the runner's time per step, the sampler's share (where the bitmask is filled and
applied), and the extra sampler time per constrained token.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.structured_outputs batch [--max-tokens 64] \
        [--threads 2] [--out results/structured_outputs_batch.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SIMPLE = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "weather": {"enum": ["sunny", "rainy", "cloudy"]},
        "days": {"type": "array", "items": {
            "type": "object",
            "properties": {"day": {"type": "integer", "minimum": 1}, "temps": {"type": "array",
                                                                             "items": {"type": "number"}},
                           "windy": {"type": "boolean"}},
            "required": ["day", "temps", "windy"], "additionalProperties": False}},
    },
    "required": ["city", "weather", "days"], "additionalProperties": False,
}
REGEX = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2} [A-Z][a-z]+( [A-Z][a-z]+)*"
CHOICE = ["positive", "negative", "neutral", "mixed feelings"]


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # json | regex | choice
    spec: object
    answer: str  # a valid output whose HF tokens drive the mask steps


WORKLOADS = [
    Workload("json_simple", "json", SIMPLE, json.dumps({"name": "Ada Lovelace", "age": 36}, separators=(",", ":"))),
    Workload("json_nested", "json", NESTED, json.dumps(
        {"city": "Paris", "weather": "rainy", "days": [{"day": d, "temps": [12.5, 14.0 + d], "windy": d % 2 == 0}
                                                       for d in range(1, 5)]}, separators=(",", ":"))),
    Workload("regex", "regex", REGEX, "2024-05-17T09:30 Saint Malo"),
    Workload("choice", "choice", CHOICE, "mixed feelings"),
]


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.version = llguidance.__version__
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, w: Workload):
        text = json.dumps(w.spec) if w.kind == "choice" else (w.spec if w.kind == "regex" else json.dumps(w.spec))
        grammar = self.ll.grammar_from({"json": "json_schema", "regex": "regex", "choice": "choice"}[w.kind], text)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def consume(self, matcher, token: int) -> None:
        if not matcher.consume_token(token):
            raise ValueError(matcher.get_error())


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import importlib.metadata

        import xgrammar

        self.xg = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, w: Workload):
        if w.kind == "json":
            compiled = self.compiler.compile_json_schema(json.dumps(w.spec))
        elif w.kind == "regex":
            compiled = self.compiler.compile_regex(w.spec)
        else:
            compiled = self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in w.spec))
        return self.xg.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask.view(1, -1), 0)

    def consume(self, matcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise ValueError(f"xgrammar refused token {token}")


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int):
        import importlib.metadata

        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.schema_regex = build_regex_from_schema
        self.version = importlib.metadata.version("outlines-core")
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, _byte_vocabulary(tokenizer))

    def compile(self, w: Workload):
        if w.kind == "json":
            regex = self.schema_regex(json.dumps(w.spec))
        elif w.kind == "regex":
            regex = w.spec
        else:
            regex = "(" + "|".join(_escape(c) for c in w.spec) + ")"
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, guide, bitmask: torch.Tensor) -> None:
        guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def consume(self, guide, token: int) -> None:
        guide.advance(token, return_tokens=False)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def _byte_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """Token bytes -> ids, undoing the GPT-2 byte-to-unicode map of a byte-level BPE vocabulary;
    special tokens are left out (outlines-core takes EOS separately)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    codes, extra = {}, 0
    for b in range(256):
        if b in printable:
            codes[chr(b)] = b
        else:
            codes[chr(256 + extra)] = b
            extra += 1
    special = set(tokenizer.all_special_ids) | {t for t in tokenizer.added_tokens_decoder}
    vocab: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special:
            continue
        vocab.setdefault(bytes(codes[ch] for ch in token), []).append(token_id)
    return vocab


def allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


def measure(engine, w: Workload, tokens: list[int], eos: int, vocab_size: int, repeats: int) -> dict:
    compiles = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matcher = engine.compile(w)
        compiles.append(time.perf_counter() - t0)
    bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    masks = []
    for token in tokens + [eos]:
        t0 = time.perf_counter()
        engine.fill(matcher, bitmask)
        masks.append(time.perf_counter() - t0)
        if not allowed(bitmask, token):
            raise ValueError(f"the mask forbids token {token} of the valid answer")
        if token != eos:
            engine.consume(matcher, token)
    return {"compile_s_median": statistics.median(compiles), "compile_s_max": max(compiles),
            "mask_s_median": statistics.median(masks), "mask_s_max": max(masks), "mask_steps": len(masks)}


def engines(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    from blockserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    vocab_size = len(tokenizer)
    results: dict = {"cpu": platform.processor() or platform.machine(), "vocab_size": vocab_size, "engines": {}}
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        entry: dict = {}
        results["engines"][cls.name] = entry
        try:
            t0 = time.perf_counter()
            engine = cls(tokenizer, vocab_size)
            entry["version"] = engine.version
            entry["tokenizer_setup_s"] = time.perf_counter() - t0
        except Exception as e:  # not installable here, or the tokenizer is not supported
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"{cls.name}: unavailable ({entry['error']})")
            continue
        for w in WORKLOADS:
            tokens = tokenizer.encode(w.answer, add_special_tokens=False)
            try:
                entry[w.name] = measure(engine, w, tokens, tokenizer.eos_token_id, vocab_size, args.repeats)
            except Exception as e:
                entry[w.name] = {"error": f"{type(e).__name__}: {e}"}
            r = entry[w.name]
            if "error" in r:
                print(f"{cls.name:14s} {w.name:12s} error: {r['error'][:120]}")
            else:
                print(f"{cls.name:14s} {w.name:12s} compile {r['compile_s_median'] * 1e3:9.2f} ms   "
                      f"mask {r['mask_s_median'] * 1e6:8.1f} us (median of {r['mask_steps']}, "
                      f"max {r['mask_s_max'] * 1e6:.0f} us)")
    write(results, args.out or "results/structured_outputs_engines.json")


STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"],
         "additionalProperties": False}
BATCH_QUESTIONS = ["Tell me a story about a dragon.", "Describe a day at the beach.", "Write about a lost key.",
                   "Tell a tale of two cities.", "Describe a storm at sea.", "Write about a robot's dream.",
                   "Tell me about a magic forest.", "Describe a busy market.", "Write about the first snow.",
                   "Tell a story about a clockmaker.", "Describe a night train.", "Write about a lighthouse.",
                   "Tell me about a brave mouse.", "Describe a mountain village.", "Write about an old map.",
                   "Tell a story about a painter."]


def batch(args: argparse.Namespace) -> None:
    from blockserve import LLM, SamplingParams
    from blockserve.sampling_params import StructuredOutputsParams

    llm = LLM(max_model_len=512, num_threads=args.threads, max_num_seqs=16, kv_cache_memory="256MiB")
    engine = llm.engine
    prompts = [llm.apply_chat_template([{"role": "user", "content": q + " Answer as JSON."}])
               for q in BATCH_QUESTIONS]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    story = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                           structured_outputs=StructuredOutputsParams(json=STORY))
    mixes = {"unconstrained": [free] * 16, "half_constrained": [story, free] * 8, "all_constrained": [story] * 16}
    llm.generate(prompts, mixes["half_constrained"], use_tqdm=False)  # warm-up (and the grammar's compile)
    steps: dict[str, list[tuple[float, float]]] = {name: [] for name in mixes}  # (sampler s, step s) per step
    for repeat in range(args.repeats):
        for name, params in mixes.items():
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                engine.add_request(f"{name}-{repeat}-{i}", prompt, p)
            tokens, first = 0, True
            while engine.has_unfinished_requests():
                before = dataclasses.replace(engine.step_timings())
                outputs = engine.step()
                after = engine.step_timings()
                if not first:  # the prefill step is not a decode step
                    steps[name].append((after.sample - before.sample, after.total - before.total))
                first = False
                tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
            if tokens != 16 * args.max_tokens:
                raise RuntimeError(f"{name}: a row ended before max_tokens")
    runs = {}
    for name, per_step in steps.items():
        runs[name] = {"decode_steps": len(per_step),
                      "sample_s_per_step": statistics.median(t for t, _ in per_step),
                      "step_s": statistics.median(t for _, t in per_step)}
    base = runs["unconstrained"]
    for name, constrained_rows in (("half_constrained", 8), ("all_constrained", 16)):
        run = runs[name]
        run["extra_sample_us_per_constrained_token"] = (
            (run["sample_s_per_step"] - base["sample_s_per_step"]) / constrained_rows * 1e6)
        run["step_time_vs_unconstrained"] = run["step_s"] / base["step_s"]
    for name, run in runs.items():
        extra = (f"   +{run['extra_sample_us_per_constrained_token']:.0f} us per constrained token, "
                 f"step x{run['step_time_vs_unconstrained']:.3f}") if name != "unconstrained" else ""
        print(f"{name:17s} step {run['step_s'] * 1e3:7.2f} ms, sampler {run['sample_s_per_step'] * 1e3:5.2f} ms "
              f"(medians of {run['decode_steps']} decode steps){extra}")
    write({"cpu": platform.processor() or platform.machine(), "threads": args.threads, "batch": 16,
           "max_tokens": args.max_tokens, "repeats": args.repeats, "statistic": "median over decode steps",
           "runs": runs}, args.out or "results/structured_outputs_batch.json")


def write(results: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("engines", help="compile and mask times of llguidance, xgrammar, outlines-core")
    e.add_argument("--repeats", type=int, default=5, help="fresh compiles per workload and engine")
    e.add_argument("--out", default=None, help="default: results/structured_outputs_engines.json")
    b = sub.add_parser("batch", help="per-token cost of a constraint in a batch of 16 on the bundled model")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--out", default=None, help="default: results/structured_outputs_batch.json")
    args = parser.parse_args()
    engines(args) if args.command == "engines" else batch(args)


if __name__ == "__main__":
    main()
