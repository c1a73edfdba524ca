"""The supported-models table in docs/models.md is the one blockserve.models.catalog generates from
the registry, and the registry's `tested` files exist and include each architecture's parity suite."""

from __future__ import annotations

from pathlib import Path

from blockserve.models.catalog import main, supported_models_table
from blockserve.models.registry import ARCHITECTURES
from tests.models.test_registry_coverage import parity_architectures

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- generated: python -m blockserve.models.catalog -->\n", "<!-- end generated -->"


def test_docs_table_is_the_generated_one():
    text = (ROOT / "docs/models.md").read_text()
    assert BEGIN in text and END in text, "docs/models.md lost its generated-table markers"
    documented = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert documented == supported_models_table(), (
        "docs/models.md's table differs from the registry's: regenerate it with python -m blockserve.models.catalog")


def test_catalog_prints_the_table(capsys):
    main()
    printed = capsys.readouterr().out
    assert printed == supported_models_table()
    assert printed.count("\n") == len(ARCHITECTURES) + 2  # header, rule, one row each


def test_tested_files_exist_and_name_the_parity_suite():
    covered = parity_architectures()
    for name, entry in ARCHITECTURES.items():
        missing = [path for path in entry.tested if not (ROOT / "tests" / path).is_file()]
        assert not missing, f"{name}: tested files {missing} do not exist"
        assert any(_runs(path, suite) for path in entry.tested for suite in covered[name]), (
            f"{name}: none of its `tested` files runs one of its parity configs {covered[name]}")


def _runs(path: str, suite: str) -> bool:
    """Whether tests/`path` is, or imports the configs of, parity suite "module:DICT[key]"."""
    module, _, configs = suite.partition(":")
    if path == module.removeprefix("tests.").replace(".", "/") + ".py":
        return True
    text = (ROOT / "tests" / path).read_text()
    return f"from {module} import" in text and configs.split("[")[0] in text
