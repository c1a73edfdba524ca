"""blockserve/server/ imports, of blockserve, only the engine and the pure-Python request and
output types (DESIGN.md's layer table)."""

import ast
from pathlib import Path

import blockserve.server

ALLOWED = ("blockserve.engine", "blockserve.server", "blockserve.sampling_params", "blockserve.scheduler.output")


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
