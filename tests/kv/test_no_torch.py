"""The CPU-side bookkeeping (`kv/`, and `scheduler/` once it exists) never imports torch."""

import importlib.util
import os
import subprocess
import sys

import pytest

PACKAGES = ["blockserve.kv"] + (["blockserve.scheduler"] if importlib.util.find_spec("blockserve.scheduler") else [])

IMPORT_ALL = """
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(getattr(package, "__path__", []), package.__name__ + "."):
    importlib.import_module(info.name)
print("\\n".join(sys.modules))
"""


def modules_after_import(package: str, path) -> set[str]:
    """What a fresh interpreter has in sys.modules after importing `package` and all its submodules."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, package], env=env, capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


@pytest.fixture
def fake_modules(tmp_path):
    """An importable stand-in for torch (so the check bites even where torch is not installed),
    and modules known to import torch and json."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "uses_torch.py").write_text("import torch\n")
    (tmp_path / "uses_json.py").write_text("import json\n")
    return tmp_path


def test_the_check_sees_what_a_module_imports(fake_modules):
    assert "json" in modules_after_import("uses_json", fake_modules)
    assert "torch" in modules_after_import("uses_torch", fake_modules)
    assert "torch" not in modules_after_import("uses_json", fake_modules)


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_the_package_does_not_import_torch(package, fake_modules):
    modules = modules_after_import(package, fake_modules)
    assert package in modules
    assert "torch" not in modules
