"""The server reaches the engine only through its public methods (DESIGN.md's layer table):

- blockserve/server/ imports, of blockserve, only the engine, the shared errors and the
  pure-Python request and output types;
- blockserve/server/, blockserve/benchmark/ and benchmarks/ never reach through an engine into
  its core (`engine.core.kv`, `llm.engine.core.runner`, `core = engine.core`, `core.scheduler`):
  what they need is an LLMEngine method (`max_model_len`, `stats()`, `reset_prefix_cache()`,
  `step_timings()`, ...).
"""

import ast
from pathlib import Path

import blockserve
import blockserve.server

# kv.hashing (torch-free): the data-parallel router hashes a prompt's leading blocks exactly as
# the replicas' prefix caches do, to send it where they are cached; config_args (stdlib only):
# it hands its own flags on to the replicas it starts.
ALLOWED = ("blockserve.engine", "blockserve.server", "blockserve.errors", "blockserve.sampling_params",
           "blockserve.scheduler.output", "blockserve.kv.hashing", "blockserve.config_args")
ROOT = Path(blockserve.__file__).resolve().parent.parent
FACADE_USERS = ("blockserve/server", "blockserve/benchmark", "benchmarks")
CORE_PARTS = {"kv", "scheduler", "runner"}


def test_server_imports_only_the_engine_layer():
    for path in Path(blockserve.server.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name == "blockserve" or name.startswith("blockserve."):
                    assert name.startswith(ALLOWED), f"{path.name} imports {name}"


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
