"""startup_gc: no automatic collection inside paused_collection(), the collector as it was after
it (also when the block raises); frozen_imports() moves what is alive into the permanent generation."""

from __future__ import annotations

import gc

import pytest

from blockserve.startup_gc import frozen_imports, paused_collection


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only a collection frees it


def _collections_while(work) -> int:
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        work()
    finally:
        gc.callbacks.remove(count)
    return len(runs)


def test_no_automatic_collection_inside_and_the_state_restored_after():
    make_cycles = lambda: [Node() for _ in range(20 * gc.get_threshold()[0])]  # noqa: E731
    assert gc.isenabled()
    assert _collections_while(make_cycles) > 0  # what the pause holds off

    with paused_collection():
        assert not gc.isenabled()
        assert _collections_while(make_cycles) == 0
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with paused_collection():
            raise RuntimeError("load failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_collection():
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


def test_frozen_imports_freeze_what_is_alive():
    frozen = gc.get_freeze_count()
    try:
        with frozen_imports():
            assert not gc.isenabled()
            kept = Node()
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        assert not any(obj is kept for obj in gc.get_objects())  # in no generation a collection scans
    finally:
        gc.unfreeze()
