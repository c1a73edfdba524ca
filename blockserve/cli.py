"""The `blockserve` command.

    blockserve generate "Tell me a joke" "What is 2+2?" --max-tokens 64
    blockserve generate --file prompts.txt --jsonl > out.jsonl      (one prompt per line; - is stdin)
    blockserve chat                                                  (interactive, streamed)
    blockserve serve --port 8000                                     (OpenAI-compatible HTTP server)
    blockserve bench throughput|latency|serve                        (benchmarks; see blockserve bench -h)

`--model` takes a Hugging Face directory or a .gguf file; it defaults to the bundled SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from blockserve.engine.config import EngineConfig
from blockserve.kv.specs import KV_CACHE_DTYPES
from blockserve.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: bundled SmolLM2-135M)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default="1GiB", help="bytes with a unit (4GiB) or a fraction of free memory")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--attention-backend", default="exact", choices=["exact", "whole_block"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="K/V storage of attention layers (auto: the model's dtype; float16 halves KV memory "
                        "and reads, attention still computes in float32)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.add_argument("--poison", action="store_true", help="fill garbage KV blocks with NaN (debugging)")
    g.add_argument("--no-quantized-matmul", action="store_true",
                   help="GGUF models: float32 weights only (by default batches of up to 16 rows read the "
                        "file's Q4_0/Q4_1/Q8_0 blocks)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.num_threads,
        poison=args.poison,
        quantized_matmul=not args.no_quantized_matmul,
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--repetition-penalty", type=float, default=1.0)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from blockserve.engine.llm import LLM

    prompts = list(args.prompts)
    if args.file:
        stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts:
        print("error: give prompts as arguments or with --file (use - for stdin)", file=sys.stderr)
        return 2
    llm = LLM(**vars(engine_config(args)))
    params = sampling_params(args)
    if args.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "text": completion.text, "finish_reason": completion.finish_reason,
                              "num_prompt_tokens": len(output.prompt_token_ids),
                              "num_generated_tokens": len(completion.token_ids),
                              "num_cached_tokens": output.num_cached_tokens}, ensure_ascii=False))
        else:
            print(f"### {prompt}\n{completion.text}\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from blockserve.engine.llm import LLM

    llm = LLM(**vars(engine_config(args)))
    engine = llm.engine
    params = sampling_params(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("blockserve chat: type a message, or /exit to quit.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        request_id = f"chat-{turn}"
        turn += 1
        try:
            engine.add_request(request_id, llm.apply_chat_template(messages), params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        shown = 0
        reply = ""
        while engine.has_unfinished_requests():
            for output in engine.step():
                reply = output.outputs[0].text
                print(reply[shown:], end="", flush=True)
                shown = len(reply)
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> int:
    from blockserve.server.app import run_server

    return run_server(args, engine_config(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="blockserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-q", "--quiet", action="store_true", help="do not log engine start-up (capacity report)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--file", help="one prompt per line; - reads stdin")
    gen.add_argument("--jsonl", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streamed")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=[],
                       help="accepted bearer token (repeatable; or BLOCKSERVE_API_KEY=k1,k2); default: no auth")
    serve.add_argument("--prefix-cache-isolation", choices=["none", "per-key"], default="none",
                       help="per-key: derive each request's cache salt from its API key (tenants share no blocks)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    from blockserve.benchmark import add_bench_parser

    add_bench_parser(sub)  # bench throughput | latency | serve

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("blockserve").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
