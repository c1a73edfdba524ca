"""The `blockserve` command.

    blockserve generate "Tell me a joke" "What is 2+2?" --max-tokens 64   (through the model's chat template)
    blockserve generate --no-chat-template "Once upon a time"       (raw completion, no chat template)
    blockserve generate --file prompts.txt --jsonl > out.jsonl      (one prompt per line; - is stdin)
    blockserve chat                                                  (interactive, streamed)
    blockserve serve --port 8000                                     (OpenAI-compatible HTTP server)
    blockserve serve --data-parallel-size 2                          (2 engine replicas, prefix-affinity routing)
    blockserve bench throughput|latency|serve|gpu-check              (benchmarks; see blockserve bench -h)

`--model` takes a Hugging Face directory or a .gguf file; it defaults to the bundled SmolLM2.
Every command runs with OMP_WAIT_POLICY=PASSIVE unless the environment sets a wait policy
(blockserve/thread_policy.py says why).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from blockserve.config_args import add_config_arguments, config_from_namespace, namespace_values
from blockserve.engine.config import EngineConfig
from blockserve.sampling_params import SamplingParams
from blockserve.server.config import DEFAULT_MODEL_NAME, ServerConfig
from blockserve.server.deferred_schemas import deferred_schemas
from blockserve.startup_gc import frozen_imports, paused_collection
from blockserve.data_parallel.routing import DataParallelConfig
from blockserve.thread_policy import apply_defaults


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the serve flags describe, resolved: without --served-model-name the
    model answers to --model (or the bundled model's name); without --api-key, the keys come
    from BLOCKSERVE_API_KEY=k1,k2 (none: no authentication)."""
    env_keys = tuple(key for key in os.environ.get("BLOCKSERVE_API_KEY", "").split(",") if key)
    values = namespace_values(ServerConfig, args)
    return ServerConfig(**{**values, "served_model_name": values.get("served_model_name") or args.model
                           or DEFAULT_MODEL_NAME, "api_keys": values.get("api_keys") or env_keys})


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


CHAT_MODE = "chat mode: prompts go through the model's chat template (--no-chat-template for raw completion)"
RAW_MODE = "completion mode: prompts go to the model as written (--no-chat-template)"
RAW_NO_TEMPLATE = "completion mode: this model has no chat template, so prompts go to the model as written"


def has_chat_template(llm) -> bool:
    """Whether the model's tokenizer carries a chat template (a model without a tokenizer has none)."""
    return bool(getattr(llm.get_tokenizer(), "chat_template", None))


def generate_mode(args: argparse.Namespace, llm) -> tuple[bool, str]:
    """(whether prompts go through the chat template, the line that says so). The template
    applies by default where the model has one, as --chat-template asks; --no-chat-template
    completes raw. --chat-template on a model without one is an error, not a silent fallback."""
    if args.chat_template is False:
        return False, RAW_MODE
    if has_chat_template(llm):
        return True, CHAT_MODE
    if args.chat_template:
        raise ValueError("this model has no chat template; drop --chat-template to complete the prompts as written")
    return False, RAW_NO_TEMPLATE


def cmd_generate(args: argparse.Namespace) -> int:
    """Each prompt as one user message through the model's chat template (when it has one and
    --no-chat-template is not given), else completed as written; the mode goes to stderr."""
    with paused_collection():
        from blockserve.engine.llm import LLM

    prompts = list(args.prompts)
    if args.file:
        stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts:
        print("error: give prompts as arguments or with --file (use - for stdin)", file=sys.stderr)
        return 2
    llm = LLM(**vars(config_from_namespace(EngineConfig, args)))
    params = sampling_params(args)
    use_template, mode = generate_mode(args, llm)
    print(mode, file=sys.stderr)
    if use_template:
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
    with paused_collection():
        from blockserve.engine.llm import LLM

    llm = LLM(**vars(config_from_namespace(EngineConfig, args)))
    if not has_chat_template(llm):
        raise ValueError("this model has no chat template, so it cannot chat; "
                         "blockserve generate completes prompts as written")
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
    config = server_config(args)
    if config.data_parallel_size > 1:  # N replicas behind one routing front end
        from blockserve.data_parallel.router import run_router

        return run_router(config_from_namespace(EngineConfig, args), config,
                          config_from_namespace(DataParallelConfig, args), quiet=args.quiet)
    with frozen_imports(), deferred_schemas():  # the server process's own: it freezes its heap after start-up too
        from blockserve.server.app import run_server

    return run_server(config_from_namespace(EngineConfig, args), config)


def build_parser(bench: bool = True) -> argparse.ArgumentParser:
    """The `blockserve` parser: every subcommand with its flags; `args.func` runs one. With `bench`
    false, `bench` is listed but its subcommands are not built: their modules import torch and
    transformers' model code, seconds of a start that serves or generates."""
    parser = argparse.ArgumentParser(prog="blockserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-q", "--quiet", action="store_true", help="do not log engine start-up (capacity report)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--file", help="one prompt per line; - reads stdin")
    gen.add_argument("--jsonl", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap each prompt as a user message in the model's chat template: the default where "
                          "the model has one (--chat-template then requires it); --no-chat-template completes "
                          "the prompts as written")
    add_config_arguments(gen, EngineConfig, title="engine")
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streamed")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_config_arguments(chat, EngineConfig, title="engine")
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_config_arguments(serve, ServerConfig, title="server", defaults={"served_model_name": None})
    add_config_arguments(serve, DataParallelConfig, title="data parallel (with --data-parallel-size > 1)")
    add_config_arguments(serve, EngineConfig, title="engine")
    serve.set_defaults(func=cmd_serve)

    from blockserve.bench import HELP, add_bench_parser

    if bench:
        add_bench_parser(sub)  # bench throughput | latency | serve | gpu-check
    else:
        sub.add_parser("bench", help=HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    apply_defaults()  # the OpenMP wait policy (thread_policy.py): before anything loads torch
    args = build_parser(bench="bench" in argv).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("blockserve").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
