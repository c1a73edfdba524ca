"""`tp_full`: the slower tensor-parallel checks (more families, more fault kinds), each a few
seconds of process start-up; skipped unless BLOCKSERVE_TP_FULL=1 (CI sets it), so the default
suite keeps one engine per property."""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "tp_full: slower tensor-parallel checks; run with BLOCKSERVE_TP_FULL=1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("BLOCKSERVE_TP_FULL") == "1":
        return
    skip = pytest.mark.skip(reason="a slower tensor-parallel check: set BLOCKSERVE_TP_FULL=1 to run it")
    for item in items:
        if "tp_full" in item.keywords:
            item.add_marker(skip)
