"""Engine and server flags are declared once, on EngineConfig's and ServerConfig's fields, and
parse exactly as the hand-written flags did (README, Makefile, benchmarks and tests use them)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from blockserve.cli import build_parser, server_config
from blockserve.config_args import add_config_arguments, cli_fields, config_from_namespace, flag_name, namespace_values
from blockserve.engine.config import ATTENTION_BACKENDS, EngineConfig
from blockserve.server.config import DEFAULT_MODEL_NAME, ServerConfig

# The engine flags as `add_engine_args` wrote them out by hand, before they were generated.
ENGINE_FLAGS = {"--model", "--max-model-len", "--block-size", "--kv-cache-memory", "--max-num-seqs",
                "--max-num-batched-tokens", "--no-prefix-caching", "--attention-backend", "--kv-cache-dtype",
                "--k-cache-dtype", "--v-cache-dtype",
                "--num-threads", "--no-adaptive-threads", "--poison", "--no-quantized-matmul", "--state-checkpoint-share",
                "--state-checkpoint-interval", "--state-checkpoint-savings-weight",
                "--tensor-parallel-size", "--distributed-executor", "--distributed-timeout-s",
                "--distributed-startup-timeout-s", "--device", "--dtype", "--gpu-memory-utilization",
                "--quantized-activations", "--quantized-max-rows", "--enforce-eager", "--cuda-graph-sizes",
                "--async-scheduling", "--kv-offload-dir", "--kv-offload-size", "--kv-offload-queue", "--kv-offload-memory",
                "--speculative-config",
                "--json-max-integer-digits", "--json-max-fraction-digits", "--json-max-whitespace"}
SERVER_FLAGS = {"--host", "--port", "--api-key", "--prefix-cache-isolation", "--served-model-name",
                "--max-waiting-requests", "--max-waiting-tokens", "--shutdown-timeout",
                "--max-request-body-bytes", "--max-json-depth", "--max-n", "--max-prompts", "--max-stop",
                "--max-stop-length", "--request-timeout", "--stream-stall-timeout", "--header-timeout",
                "--body-timeout", "--protect-health-and-metrics", "--data-parallel-size",
                "--min-request-timeout", "--max-connections", "--reasoning-parser"}
OFF_CLI = {"enable_chunked_prefill", "max_prefill_chunk", "scheduling_policy", "check_integrity",
           "unsafe_disable_zeroing", "seed"}

FULL = ["--model", "m", "--max-model-len", "512", "--block-size", "32", "--kv-cache-memory", "0.2",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--no-prefix-caching",
        "--attention-backend", "whole_block", "--kv-cache-dtype", "float16", "--num-threads", "2", "--poison",
        "--no-quantized-matmul"]
# argv -> the EngineConfig the hand-written engine_config() built from it (checked against it first)
ENGINE_CASES = [
    ([], EngineConfig()),
    (FULL, EngineConfig(model="m", max_model_len=512, block_size=32, kv_cache_memory="0.2", max_num_seqs=8,
                        max_num_batched_tokens=64, enable_prefix_caching=False, attention_backend="whole_block",
                        kv_cache_dtype="float16", num_threads=2, poison=True, quantized_matmul=False)),
    (["--kv-cache-memory", "4GiB", "--kv-cache-dtype", "bfloat16"],
     EngineConfig(kv_cache_memory="4GiB", kv_cache_dtype="bfloat16")),
]
# every command that takes the engine flags, with what else it needs to parse
COMMANDS = [["generate", "hi"], ["chat"], ["serve"], ["bench", "throughput"], ["bench", "latency"]]


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    return parser


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


# -- declared once -------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_every_field_is_a_flag_with_help_or_marked_off_the_command_line(cls):
    on = cli_fields(cls)  # raises on a flag without help or default, or unknown metadata
    off = {f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True) is False}
    assert {f.name for f in on} | off == {f.name for f in dataclasses.fields(cls)}
    assert all(f.metadata["help"] for f in dataclasses.fields(cls))  # off-CLI fields are documented too
    if cls is EngineConfig:
        assert off == OFF_CLI


def test_the_flags_are_the_old_ones():
    assert option_strings(engine_parser()) == ENGINE_FLAGS
    assert {flag_name(f) for f in cli_fields(ServerConfig)} == SERVER_FLAGS


def test_defaults_come_from_the_dataclass():
    args = engine_parser().parse_args([])
    for f in cli_fields(EngineConfig):
        assert getattr(args, f.name) == (None if f.default == () else f.default), f.name  # (): not repeated
    assert config_from_namespace(EngineConfig, args) == EngineConfig()


def test_attention_backend_choices_are_the_backends():
    from blockserve.attention.paged_attention import BACKENDS

    assert sorted(ATTENTION_BACKENDS) == sorted(BACKENDS)


# -- old flag names, same configs ----------------------------------------------------------------


@pytest.mark.parametrize("argv,expected", ENGINE_CASES)
def test_old_engine_flags_parse_to_the_same_config(argv, expected):
    got = config_from_namespace(EngineConfig, engine_parser().parse_args(argv))
    assert got == expected
    assert got.kv_cache_memory is None or type(got.kv_cache_memory) is str  # parse_memory reads it, as before


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("argv,expected", ENGINE_CASES[1:])
def test_every_command_parses_the_engine_flags_alike(command, argv, expected):
    args = build_parser().parse_args([*command, *argv])
    assert config_from_namespace(EngineConfig, args) == expected


@pytest.mark.parametrize("argv", [["--attention-backend", "nope"], ["--kv-cache-dtype", "int3"],
                                  ["--block-size", "x"], ["--num-threads", "1.5"]])
def test_bad_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(argv)
    assert "invalid" in capsys.readouterr().err


def test_bad_values_the_parser_accepts_are_refused_by_the_config():
    with pytest.raises(ValueError, match="power of two"):
        config_from_namespace(EngineConfig, engine_parser().parse_args(["--block-size", "3"]))


@pytest.mark.parametrize("argv, field", [(["--json-max-integer-digits", "0"], "json_max_integer_digits"),
                                         (["--json-max-fraction-digits", "11"], "json_max_fraction_digits"),
                                         (["--json-max-whitespace", "0"], "json_max_whitespace")])
def test_json_bounds_out_of_range_are_refused_naming_the_field(argv, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        config_from_namespace(EngineConfig, engine_parser().parse_args(argv))


def test_the_json_bounds_flags_build_the_engines_bounds():
    from blockserve.structured import JsonBounds

    config = config_from_namespace(EngineConfig, engine_parser().parse_args(
        ["--json-max-integer-digits", "4", "--json-max-fraction-digits", "2", "--json-max-whitespace", "3"]))
    assert config.json_bounds == JsonBounds(max_integer_digits=4, max_fraction_digits=2, max_whitespace=3)
    assert EngineConfig().json_bounds == JsonBounds()  # llama.cpp's 16 digits by default


def test_bench_leaves_kv_cache_memory_unset_and_the_config_keeps_its_default():
    args = build_parser().parse_args(["bench", "latency"])
    assert args.kv_cache_memory is None  # sized to the workload
    assert config_from_namespace(EngineConfig, args).kv_cache_memory == EngineConfig().kv_cache_memory
    args = build_parser().parse_args(["bench", "throughput", "--kv-cache-memory", "64MiB"])
    assert config_from_namespace(EngineConfig, args).kv_cache_memory == "64MiB"


def test_round_trip_config_to_flags_and_back():
    config = dataclasses.replace(ENGINE_CASES[1][1], num_threads=3, cuda_graph_sizes=(1, 4))
    argv = []
    for f in cli_fields(EngineConfig):
        value = getattr(config, f.name)
        if isinstance(value, bool):
            argv += [flag_name(f)] if value != f.default else []
        elif isinstance(value, tuple):
            argv += [part for item in value for part in (flag_name(f), str(item))]
        elif value is not None:
            argv += [flag_name(f), str(value)]
    assert config_from_namespace(EngineConfig, engine_parser().parse_args(argv)) == config


# -- the server ----------------------------------------------------------------------------------


def test_old_serve_flags(monkeypatch):
    monkeypatch.delenv("BLOCKSERVE_API_KEY", raising=False)
    parser = build_parser()
    defaults = server_config(parser.parse_args(["serve"]))
    assert defaults == ServerConfig(served_model_name=DEFAULT_MODEL_NAME, api_keys=(), prefix_cache_isolation="none",
                                    host="127.0.0.1", port=8000)
    args = parser.parse_args(["serve", "--host", "0.0.0.0", "--port", "9000", "--api-key", "a", "--api-key", "b",
                              "--prefix-cache-isolation", "per-key", "--model", "some/dir"])
    assert server_config(args) == ServerConfig("some/dir", ("a", "b"), "per-key", host="0.0.0.0", port=9000)
    named = server_config(parser.parse_args(["serve", "--served-model-name", "x", "--model", "some/dir"]))
    assert named.served_model_name == "x"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefix-cache-isolation", "shared"])


def test_api_keys_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("BLOCKSERVE_API_KEY", "k1,,k2")
    parser = build_parser()
    assert server_config(parser.parse_args(["serve"])).api_keys == ("k1", "k2")
    assert server_config(parser.parse_args(["serve", "--api-key", "a"])).api_keys == ("a",)


def test_an_empty_api_key_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        server_config(build_parser().parse_args(["serve", "--api-key", ""]))


# -- the generic module ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Example:
    name: str = field(default="x", metadata={"help": "a name"})
    tags: tuple[str, ...] = field(default=(), metadata={"help": "a tag (repeatable)", "flag": "--tag"})
    on: bool = field(default=True, metadata={"help": "turn it off"})
    ratio: float | None = field(default=None, metadata={"help": "a ratio of 50%"})
    hidden: int = field(default=7, metadata={"help": "set in code", "cli": False})


def test_generic_flag_kinds():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, _Example, only=["tags", "on", "ratio"])
    assert option_strings(parser) == {"--tag", "--no-on", "--ratio"}
    assert "50%" in parser.format_help()
    args = parser.parse_args(["--tag", "a", "--tag", "b", "--no-on", "--ratio", "0.5"])
    assert namespace_values(_Example, args) == {"tags": ("a", "b"), "on": False, "ratio": 0.5}
    assert config_from_namespace(_Example, args, hidden=1) == _Example("x", ("a", "b"), False, 0.5, 1)
    assert config_from_namespace(_Example, parser.parse_args([])) == _Example()


def test_generic_mistakes_are_named():
    @dataclass(frozen=True)
    class NoHelp:
        size: int = 1

    @dataclass(frozen=True)
    class Typo:
        size: int = field(default=1, metadata={"hlep": "size"})

    @dataclass(frozen=True)
    class Ambiguous:
        size: int | str = field(default=1, metadata={"help": "size"})

    for cls, message in ((NoHelp, "without help"), (Typo, "unknown flag metadata"), (Ambiguous, "metadata 'type'")):
        with pytest.raises(TypeError, match=message):
            add_config_arguments(argparse.ArgumentParser(), cls)
    with pytest.raises(TypeError, match="not command-line fields"):
        add_config_arguments(argparse.ArgumentParser(), _Example, only=["hidden"])
    with pytest.raises(TypeError, match="not command-line fields"):
        add_config_arguments(argparse.ArgumentParser(), _Example, defaults={"nope": 1})
