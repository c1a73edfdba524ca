"""Speculative decoding (n-gram prompt lookup, suffix decoding, a draft model) against plain decoding on
the bundled model: output tok/s per task at batch 1 and 16, greedy, with the outputs checked byte-identical.

    python -m benchmarks.spec_decode [--max-tokens 96] [--k 4] [--rounds 3] [--methods ngram suffix]
    python -m benchmarks.spec_decode --methods draft_model [--draft-model PATH]
    python -m benchmarks.spec_decode --quantized-activations int8 ...   (both engines' matmuls at int8)

The draft model defaults to the bundled model itself: no smaller model of its vocabulary ships, so
that row measures the acceptance ceiling and the draft's overhead, not a speed-up (a draft as costly
as the target cannot pay).

Suffix decoding runs over each request's own tokens only (suffix_decoding_max_cached_requests 0):
every round repeats the same prompts, whose earlier answers a cross-request trie would replay.

    python -m benchmarks.spec_decode --hybrid qwen3_next [--acceptance 1.0 0.8 0.5]

`--hybrid FAMILY`: the rollback's cost on a small random hybrid shape (qwen3_next: Gated DeltaNet,
granitemoehybrid: Mamba2; 8 layers, 3 of 4 recurrent, hidden 256, vocab 4096) at batch 1. A
random model copies nothing from its prompt, so n-gram drafts find nothing to accept there; the
drafts replay the model's own greedy reply instead, each position right with probability
`acceptance` (the rest spoiled), which stands in for an input-grounded task at that acceptance:
every verification with a rejected draft rolls the state slots back to the last accepted token.

Tasks: three grounded in their input (edit a given code file, answer from a given document,
continue a repetitive list), where the output repeats the prompt, and open-ended chat, where it
does not. Prints one JSON line per (method, task, batch) with the medians of `rounds` runs and their
ratio, twice: output tok/s over the whole call (the prompt's prefill included, which speculation does
not touch) and over the decode phase (after every request has its first token); then the acceptance
figures, the CPU flags and the other processes' CPU share while it ran.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass

from benchmarks.cpu_share import CpuShare
from blockserve import LLM, SamplingParams
from blockserve.bench.common import cpu_simd_flags
from blockserve.engine.config import DEFAULT_QUANTIZED_ACTIVATIONS, QUANTIZED_ACTIVATIONS
from blockserve.models.loader import default_model_path

CODE = '''def load_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            name, value = line.split(",")
            rows.append((name, float(value)))
    return rows


def total(rows):
    result = 0.0
    for name, value in rows:
        result += value
    return result
'''
DOCUMENT = ("The Harbor Street library opens at 9 am on weekdays and at 10 am on Saturdays. It is closed on "
            "Sundays. Members may borrow up to eight books for three weeks; films are lent for one week. Late "
            "returns cost 20 cents a day per item. The reading room on the second floor is reserved for quiet "
            "study, and the children's corner on the ground floor hosts a story hour every Wednesday at 4 pm.")
TASKS = {
    "edit-code": f"Rename the function load_rows to read_rows everywhere in this file and return the whole "
                 f"file.\n\n{CODE}\nThe edited file:\n",
    "answer-from-document": f"{DOCUMENT}\n\nQuote the sentences of the text above that say when the library "
                            f"opens and how long books may be borrowed.\n\nQuote:",
    "continue-list": "Monday: check the logs, update the tickets, review the pull requests.\nTuesday: check the "
                     "logs, update the tickets, review the pull requests.\nWednesday: check the logs, update the "
                     "tickets, review the pull requests.\nThursday:",
    "open-chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
CHAT_TASKS = ("open-chat",)  # sent as a user turn through the model's chat template (raw, it ends at once)


def task_prompt(llm: LLM, task: str) -> str:
    """The text sent for `task`: its prompt as written, or for a chat task, rendered by the chat template."""
    if task not in CHAT_TASKS:
        return TASKS[task]
    messages = [{"role": "user", "content": TASKS[task]}]
    return llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


METHODS = {  # each method's fields
    "ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"suffix_decoding_max_cached_requests": 0},
    "draft_model": {},  # "model": --draft-model
}


@dataclass(frozen=True)
class Run:
    """One batch generated: output tok/s over the whole call (prompt included), tok/s of the decode
    phase (the tokens emitted after every request had its first one, over the seconds after that), and
    each request's text."""

    rate: float
    decode_rate: float
    texts: list[str]


def run(llm: LLM, prompt: str, batch: int, params: SamplingParams) -> Run:
    engine = llm.engine
    ids = [f"bench-{uuid.uuid4().hex}" for _ in range(batch)]
    began = time.perf_counter()
    for request_id in ids:
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, int] = {}
    finished: dict[str, str] = {}
    decode_began = decode_tokens = None
    while len(finished) < batch:
        for output in engine.step():
            tokens[output.request_id] = len(output.outputs[0].token_ids)
            if output.finished:
                finished[output.request_id] = output.outputs[0].text
        if decode_began is None and len(tokens) == batch:  # every request has its first token(s)
            decode_began, decode_tokens = time.perf_counter(), sum(tokens.values())
    seconds = time.perf_counter() - began
    decode_seconds = time.perf_counter() - decode_began
    total = sum(tokens.values())
    return Run(total / seconds, (total - decode_tokens) / decode_seconds if decode_seconds > 0 else 0.0,
               [finished[request_id] for request_id in ids])


def hybrid_config(family: str):
    """A small hybrid shape of `family` (random weights): 8 layers, 3 of every 4 recurrent."""
    from transformers import GraniteMoeHybridConfig, Qwen3NextConfig

    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 2
    common = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, layer_types=layer_types,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "qwen3_next":
        return Qwen3NextConfig(**common, intermediate_size=512, head_dim=64, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                               shared_expert_intermediate_size=256)
    return GraniteMoeHybridConfig(**common, intermediate_size=128, shared_intermediate_size=512,
                                  num_local_experts=8, num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2,
                                  mamba_d_state=64, mamba_d_head=64, mamba_d_conv=4, mamba_chunk_size=64,
                                  position_embedding_type="rope")


class ReplayProposer:
    """Drafts the known greedy reply of the prompt, each position right with probability `acceptance`
    (a seeded draw per position), wrong from the first spoiled one on."""

    def __init__(self, prompt: list[int], reply: list[int], acceptance: float, vocab: int):
        self.prompt, self.reply, self.acceptance, self.vocab = prompt, reply, acceptance, vocab

    def propose(self, request_id, token_ids, max_tokens: int) -> list[int]:
        done = len(token_ids) - len(self.prompt)
        truth = self.reply[done:done + max_tokens]
        draws = random.Random(len(token_ids))
        right = next((i for i in range(len(truth)) if draws.random() >= self.acceptance), len(truth))
        return truth[:right] + [(t + 1) % self.vocab for t in truth[right:]]

    def forget(self, request_id) -> None:
        """Holds nothing per request."""

    @property
    def num_requests(self) -> int:
        return 0


def hybrid_main(args) -> None:
    """Batch-1 tok/s with and without speculation on a random hybrid shape, per draft acceptance."""
    from blockserve.models.random_checkpoint import save_random_model
    from blockserve.spec_decode import speculator

    config = hybrid_config(args.hybrid)
    with tempfile.TemporaryDirectory() as path:
        save_random_model(config, path)
        plain = LLM(path, enable_prefix_caching=False, max_model_len=1024)
        prompt = random.Random(0).choices(range(config.vocab_size), k=200)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        reply = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        flags = cpu_simd_flags()
        make_proposer = speculator.make_proposer
        for acceptance in args.acceptance:
            # The engine's speculator takes its proposer from make_proposer: the replay, for this engine only.
            speculator.make_proposer = lambda _: ReplayProposer(prompt, reply, acceptance, config.vocab_size)
            try:
                speculative = LLM(path, enable_prefix_caching=False, max_model_len=1024,
                                  speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
            finally:
                speculator.make_proposer = make_proposer
            rates = {"plain": [], "speculative": []}
            outputs, step_ms = {}, {}
            with CpuShare() as share:
                for _ in range(args.rounds):
                    for name, llm in (("plain", plain), ("speculative", speculative)):
                        timings = llm.engine.step_timings()
                        forward, steps = timings.forward, timings.steps
                        began = time.perf_counter()
                        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
                        rates[name].append(len(out) / (time.perf_counter() - began))
                        outputs[name] = out
                        # The runner's forward per step, the prompt's step included (the same in both).
                        step_ms.setdefault(name, []).append(1000 * (timings.forward - forward)
                                                            / (timings.steps - steps))
            stats = speculative.engine.stats().speculation
            plain_rate, spec_rate = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
            print(json.dumps({
                "hybrid": args.hybrid, "draft_acceptance": acceptance, "batch": 1, "max_tokens": args.max_tokens,
                "k": args.k, "plain_tok_s": round(plain_rate, 1), "speculative_tok_s": round(spec_rate, 1),
                "ratio": round(spec_rate / plain_rate, 2), "identical": outputs["plain"] == outputs["speculative"],
                "plain_forward_ms_per_step": round(statistics.median(step_ms["plain"]), 2),
                "speculative_forward_ms_per_step": round(statistics.median(step_ms["speculative"]), 2),
                "acceptance_rate": round(stats.acceptance_rate, 2) if stats.num_draft_tokens else None,
                "mean_accepted_length": round(stats.mean_accepted_length, 2) if stats.num_verifications else None,
                "others_cpu_share": None if share.others is None else round(share.others, 2), "cpu_flags": flags,
            }), flush=True)
            speculative.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=sorted(METHODS))
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--draft-model", default=None,
                        help="draft_model: the draft's path (default: the bundled model, its own draft)")
    parser.add_argument("--hybrid", choices=["qwen3_next", "granitemoehybrid"], default=None,
                        help="measure the state rollback on a random hybrid shape instead (batch 1)")
    parser.add_argument("--quantized-activations", choices=QUANTIZED_ACTIVATIONS,
                        default=DEFAULT_QUANTIZED_ACTIVATIONS, help="the bundled model's matmul activations, in both "
                        "engines alike (not --hybrid's)")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[1.0, 0.8, 0.5],
                        help="--hybrid: the replayed drafts' chance of being right, per position")
    args = parser.parse_args()
    if args.hybrid:
        hybrid_main(args)
        return
    engine_args = dict(enable_prefix_caching=False, quantized_activations=args.quantized_activations)
    plain = LLM(**engine_args)
    fields = {**METHODS, "draft_model": {"model": args.draft_model or str(default_model_path())}}
    speculatives = {method: LLM(**engine_args, speculative_config={
        "method": method, "num_speculative_tokens": args.k, **fields[method]}) for method in args.methods}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    flags = cpu_simd_flags()
    prompts = {task: task_prompt(plain, task) for task in args.tasks}
    for batch, (method, speculative), (task, prompt) in itertools.product(args.batches, speculatives.items(),
                                                                          prompts.items()):
        rates = {"plain": [], "speculative": []}
        decode_rates = {"plain": [], "speculative": []}
        texts = {}
        before = speculative.engine.stats().speculation
        with CpuShare() as share:
            for _ in range(args.rounds):
                for name, llm in (("plain", plain), ("speculative", speculative)):
                    result = run(llm, prompt, batch, params)
                    rates[name].append(result.rate)
                    decode_rates[name].append(result.decode_rate)
                    texts[name] = result.texts
        after = speculative.engine.stats().speculation
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        verifications = after.num_verifications - before.num_verifications
        plain_rate, spec_rate = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
        print(json.dumps({
            "method": method, "task": task, "batch": batch, "max_tokens": args.max_tokens, "k": args.k,
            "quantized_activations": args.quantized_activations,
            "plain_tok_s": round(plain_rate, 1), "speculative_tok_s": round(spec_rate, 1),
            "ratio": round(spec_rate / plain_rate, 2),
            "plain_decode_tok_s": round(statistics.median(decode_rates["plain"]), 1),
            "speculative_decode_tok_s": round(statistics.median(decode_rates["speculative"]), 1),
            "decode_ratio": round(statistics.median(decode_rates["speculative"])
                                  / statistics.median(decode_rates["plain"]), 2),
            "identical": texts["plain"] == texts["speculative"],
            "acceptance_rate": round(accepted / drafted, 2) if drafted else None,
            "mean_accepted_length": round(1 + accepted / verifications, 2) if verifications else None,
            "others_cpu_share": None if share.others is None else round(share.others, 2),
            "cpu_flags": flags,
        }), flush=True)


if __name__ == "__main__":
    main()
