"""The packages' layers, as docs/design.md's table states them, checked on the code's imports:

- each package imports, of blockserve, only the packages below it (LAYERS), so the import graph
  has no circle and no upward arrow; the server's sub-packages are layered the same way;
- blockserve/server/, blockserve/data_parallel/, blockserve/bench/ and benchmarks/ never reach
  through an engine into its core (`engine.core.kv`, `llm.engine.core.runner`, `core = engine.core`,
  `core.scheduler`): what they need is an LLMEngine method (`max_model_len`, `stats()`,
  `reset_prefix_cache()`, `step_timings()`, ...).
"""

import ast
from pathlib import Path

import blockserve

ROOT = Path(blockserve.__file__).resolve().parent.parent
PACKAGE = ROOT / "blockserve"
FACADE_USERS = ("blockserve/server", "blockserve/data_parallel", "blockserve/bench", "benchmarks")
CORE_PARTS = {"kv", "scheduler", "runner"}

# What each layer may import, of blockserve. A layer is a package, a top-level module, or one of the
# server's parts; the server's config and wire format (server.base) sit under its sub-packages.
BASE = {"errors", "sampling_params", "cached_directory", "config_args", "thread_policy", "startup_gc"}
LAYERS = {
    "errors": set(), "sampling_params": set(), "cached_directory": set(), "config_args": set(),
    "thread_policy": set(), "startup_gc": set(),
    "kv": BASE,
    "spec_decode": BASE,
    "scheduler": BASE | {"kv", "spec_decode"},
    "structured": BASE,
    "native": BASE,
    "tensor_parallel": BASE,
    "attention": BASE | {"kv", "native"},
    "models": BASE | {"kv", "native", "attention", "tensor_parallel"},
    "worker": BASE | {"kv", "native", "attention", "scheduler", "spec_decode", "structured", "models"},
    "distributed": BASE | {"kv", "attention", "tensor_parallel", "models", "worker"},
    "engine": BASE | {"kv", "scheduler", "spec_decode", "structured", "attention", "models", "worker",
               "distributed"},
    "sim": BASE | {"kv", "scheduler", "spec_decode"},
    "bench": BASE | {"kv", "attention", "models", "worker", "engine"},  # attention, worker: the GPU check
    # the server reaches the engine only through its public methods; kv.hashing and
    # scheduler.output are torch-free value types it shares with the engine
    "server.base": BASE | {"engine"},
    "server.http": BASE | {"server.base"},
    "server.engine_bridge": BASE | {"engine", "scheduler", "server.base", "server.http"},
    "server.tools": BASE | {"engine", "structured", "server.base", "server.http"},  # structured: JSON bounds
    "server.openai_api": BASE | {"engine", "server.base", "server.http", "server.engine_bridge", "server.tools"},
    "server.app": BASE | {"engine", "server.base", "server.http", "server.engine_bridge", "server.openai_api",
                   "server.tools"},
    # the data-parallel front end hashes prompts as the replicas' prefix caches do (kv.hashing)
    "data_parallel": BASE | {"kv", "engine", "server.base", "server.http", "server.engine_bridge"},
    "cli": BASE | {"engine", "bench", "server.app", "server.base", "data_parallel"},
    "__init__": BASE | {"engine"},
}
SERVER_PARTS = ("http", "engine_bridge", "openai_api", "tools")


def layer_of(module: str) -> str:
    """The layer of a dotted module path under blockserve (`blockserve.server.http.auth` -> `server.http`)."""
    parts = module.split(".")[1:] or ["__init__"]
    if parts[0] != "server":
        return parts[0]
    if len(parts) > 1 and parts[1] in SERVER_PARTS:
        return f"server.{parts[1]}"
    return "server.app" if parts[1:] == ["app"] else "server.base"


def imports_of(path: Path) -> set[str]:
    """Every blockserve module `path` imports, at any depth (function-local imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name for name in names if name.startswith("blockserve.")}


def test_every_package_imports_only_the_layers_below_it():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        layer = layer_of(module.removesuffix(".__init__") if path.name == "__init__.py" and path.parent != PACKAGE
                         else module)
        assert layer in LAYERS, f"{path.relative_to(ROOT)}: layer {layer!r} is not in LAYERS; add it where it belongs"
        for name in imports_of(path):
            target = layer_of(name)
            if target != layer and target not in LAYERS[layer]:
                offenders.append(f"{path.relative_to(ROOT)} ({layer}) imports {name} ({target})")
    assert not offenders, "imports against the layers:\n" + "\n".join(offenders)


def test_the_layers_have_no_circle():
    done, visiting = set(), []

    def visit(layer):
        assert layer not in visiting, "circle: " + " -> ".join([*visiting, layer])
        if layer not in done:
            visiting.append(layer)
            for below in LAYERS[layer]:
                visit(below)
            visiting.pop()
            done.add(layer)

    for layer in LAYERS:
        visit(layer)


def _dotted_root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def core_reach_through(source: str) -> list[tuple[int, str]]:
    """(line, the longest offending expression on it) for each line of `source` with an `<x>.core`
    (the core of an engine, however it is then used) or a `core.kv` / `core.scheduler` /
    `core.runner` (also `<x>_core.kv`, ...). Module paths (`blockserve.engine.core.X`) are fine."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or _dotted_root(node) == "blockserve":
            continue
        through_engine = node.attr == "core"
        value = node.value
        receiver = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""
        through_core = node.attr in CORE_PARTS and (receiver == "core" or receiver.endswith("_core"))
        if through_engine or through_core:
            expression = ast.unparse(node)
            if len(expression) > len(found.get(node.lineno, "")):
                found[node.lineno] = expression
    return sorted(found.items())


def test_the_reach_through_check_sees_what_it_should():
    source = """
from blockserve.engine.core import EngineCore
import blockserve.engine.core
x = blockserve.engine.core.EngineCore
usage = engine.core.kv.usage()
timings = llm.engine.core.runner.timings
core = engine.core
core.scheduler.stats()
engine_core.kv.usage()
engine.stats(); engine.max_model_len; self.kv.usage(); scheduler.kv
"""
    assert core_reach_through(source) == [(5, "engine.core.kv"), (6, "llm.engine.core.runner"), (7, "engine.core"),
                                          (8, "core.scheduler"), (9, "engine_core.kv")]


def test_server_and_benchmarks_use_only_the_engine_facade():
    offenders = []
    for folder in FACADE_USERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, expression in core_reach_through(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {expression}")
    assert not offenders, ("reaches through the engine into its core; use an LLMEngine method instead:\n"
                           + "\n".join(offenders))
